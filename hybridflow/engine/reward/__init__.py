"""Rewards: rule-based and custom score functions, the reward model, and reward-model training."""
