"""The controller: Prefect flows (RLHF, reward-model training), their stage tasks, pre-flight checks, run lease and
reporting."""
