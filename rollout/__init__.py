"""Rollouts (the registry: hf, vllm): sampling responses from the actor's weights."""
