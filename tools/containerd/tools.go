//go:build tools

// Package tools pins containerd 2 for the sandbox's real node (`vgpu sandbox up --real-node`):
// containerd itself, its runc shim and ctr. Debian's containerd (1.6) has no CDI, which DRA
// drivers hand devices to containers through, and the kubelet from 1.37 on needs a runtime
// that answers the CRI's RuntimeConfig (containerd 2.0 and later). runc stays Debian's.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
