//go:build tools

// Package tools pins NVIDIA's nvidia-ctk and nvidia-container-runtime
// (github.com/NVIDIA/nvidia-container-toolkit): roles/gpu_node runs nvidia-ctk to add the nvidia
// runtime to containerd's config.toml and to set the toolkit's config, and the runtime is then
// containerd's default; the sandbox's real node builds both here because the toolkit's Debian
// package comes from NVIDIA's repository, which machines without internet cannot reach.
package tools

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
)
