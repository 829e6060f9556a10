"""The kube-scheduler extender and admission webhook: thin HTTP shell over vgpu.extender.state."""
