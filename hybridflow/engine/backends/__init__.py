"""Training engines (the registry: ddp, fsdp, megatron), the actor and critic updates over them, and the
3D-HybridEngine that reshards the megatron actor for generation."""
