//go:build tools

// Package tools pins crictl (sigs.k8s.io/cri-tools), which the sandbox's real node uses to stop
// and remove its pod sandboxes through the CRI (network torn down, namespaces removed) and which
// the e2e tests use to look into containerd as the kubelet sees it.
package tools

import _ "sigs.k8s.io/cri-tools/cmd/crictl"
