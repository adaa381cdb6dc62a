"""The controller: Prefect flows (RLHF, reward-model training), pre-flight checks, run lease and reporting; the run
store (`store`) and the auto-mapping planner (`placement`)."""
