"""vGPU scheduler for Kubernetes: GPU sharing with hard isolation."""

__version__ = "0.1.0"
