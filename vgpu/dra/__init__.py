"""The DRA driver's node side: ``vgpu dra-plugin`` (docs/dra.md#the-node-plugin)."""
