"""Typed run configuration (pydantic), loaded from YAML with ``-o key=value`` overrides.

Sections follow verl's vocabulary, flattened one level: ``model``, ``data``, ``rollout``, ``actor``, ``ref``,
``critic``, ``algorithm``, ``reward``, ``reward_model``, ``trainer`` (verl's ``actor_rollout_ref.actor.ppo_epochs``
is our ``actor.ppo_epochs``). Unknown or ill-typed keys are errors that name the key and the allowed values.
Batch sizes: ``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts (as in verl);
micro-batch sizes count sequences (prompt + one response).

The package: `sections` (one model per section), `run` (`HybridFlowConfig`, `RMTrainingConfig`: the rules that span
sections), `loading` (YAML, overrides, resume); the names other modules use are re-exported here.
"""

from __future__ import annotations

from hybridflow.engine.config.dpo import DPOConfig, DPOTrainingConfig
from hybridflow.engine.config.loading import (
    ConfigError,
    apply_overrides,
    dotted_leaves,
    load_config,
    resume_config,
    validate_config,
)
from hybridflow.engine.config.run import (
    GroupOfOneWarning,
    HybridFlowConfig,
    OffPolicyWarning,
    PreferenceDataConfig,
    RMTrainingConfig,
    SFTDataConfig,
    SFTTrainingConfig,
)
from hybridflow.engine.config.sections import (
    ROLES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    OptimConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    Pool,
    RewardModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    TeacherConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "dotted_leaves",
    "CriticConfig",
    "DataConfig",
    "DPOConfig",
    "DPOTrainingConfig",
    "HybridFlowConfig",
    "GroupOfOneWarning",
    "OffPolicyWarning",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "Pool",
    "PreferenceDataConfig",
    "RMTrainingConfig",
    "SFTDataConfig",
    "SFTTrainingConfig",
    "ROLES",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TeacherConfig",
    "apply_overrides",
    "load_config",
    "resume_config",
    "validate_config",
]
