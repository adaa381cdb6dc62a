"""HybridFlow: RLHF after the HybridFlow paper (arXiv 2409.19256), in five layers that import one way only:
``cli -> flows -> tasks -> slurm -> engine``.

- `hybridflow.cli`: the ``hf`` command.
- `hybridflow.flows`: the Prefect flows (the single controller of each iteration), the run store and the planner.
- `hybridflow.tasks`: one Prefect task per stage, each a thin call on a worker group.
- `hybridflow.slurm`: worker groups (submitit, locally or on Slurm), the rank loop, dispatch and collect.
- `hybridflow.engine`: all that runs inside a rank: the batch protocol, config, models, algorithms, backends,
  rollouts, rewards; no Prefect or submitit.
"""
