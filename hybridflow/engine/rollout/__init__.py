"""Rollouts (hf, vllm; registered in hybridflow.engine.extensions): sampling responses from the actor's weights."""
