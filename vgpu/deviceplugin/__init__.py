"""The kubelet device plugin for vGPUs: discovery, the kubelet gRPC server, Allocate, the node monitor."""
