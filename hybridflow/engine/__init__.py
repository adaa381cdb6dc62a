"""All that runs inside a rank, with no Prefect or submitit: the DataProto batch, the run config, prompt data,
models, packing, checkpoints, metrics, trackers, the RLHF worker and the single-process trainer; the algorithms,
training backends, rollouts and rewards in their folders. The bottom of it (`torch_ops`, `protocol`, `transfer`)
imports nothing of HybridFlow."""
