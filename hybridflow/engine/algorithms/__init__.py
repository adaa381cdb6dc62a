"""The RL algorithms as pure torch functions of tensors: advantage estimators (`estimators`), KL (`kl`), Safe-RLHF's
Lagrangian (`lagrangian`), policy and value losses (`losses`). They import nothing above `hybridflow.engine.torch_ops`;
the stages that apply them (`hybridflow.engine.advantage`, `dynamic_sampling`, `iteration`) sit beside the config."""
