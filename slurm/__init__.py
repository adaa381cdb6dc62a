"""slurm: see README (built in the orchestration issue)."""
