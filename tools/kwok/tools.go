//go:build tools

// Package tools pins KWOK, which simulates the sandbox's GPU nodes.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
