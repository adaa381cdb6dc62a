"""What runs inside a worker: DataProto, algorithms, models, rollout, data, rewards, training.

Never imports Prefect or submitit, so a worker process stays light and testable alone.
"""
