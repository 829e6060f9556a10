"""The `vgpu` command line: the entry point, status and limits."""
