//go:build tools

// Package tools pins NVIDIA's nvidia-ctk (github.com/NVIDIA/nvidia-container-toolkit), which
// roles/gpu_node runs to add the nvidia runtime to containerd's config.toml; the sandbox's real
// node builds it here because the toolkit's Debian package comes from NVIDIA's repository, which
// machines without internet cannot reach.
package tools

import _ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
