"""The kubelet device plugin for vGPUs (v1beta1): the gRPC server, Allocate, the Lease's reporter,
MIG on demand."""
