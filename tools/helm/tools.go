//go:build tools

// Package tools pins helm, which the chart tests and the playbooks run.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
