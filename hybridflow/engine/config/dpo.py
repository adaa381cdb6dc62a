"""The config of a DPO run (``hf dpo train``): preference optimisation of a policy against a frozen reference on
offline preference pairs (`hybridflow.engine.dpo`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from hybridflow.engine.config.run import EpochTrainerConfig, PreferenceDataConfig, _OneGroupRun
from hybridflow.engine.config.sections import OptimConfig, PlacementConfig, PolicyModelConfig, _Section


class DPOConfig(_Section):
    """The preference loss (TRL's ``DPOConfig`` keys): ``loss_type`` sigmoid (DPO, Rafailov et al. 2023, eq. 7) or
    ipo (Azar et al. 2023, eq. 17, on each response's per-token mean log-probability as TRL computes it)."""

    beta: float = Field(0.1, gt=0.0, description="the KL weight: how far the policy may move from the reference")
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="sigmoid only: the share of pairs assumed mislabelled (cDPO, robust DPO)"
    )
    ref_model_path: str | None = Field(
        None, description="the frozen reference's folder (None: model.path, the policy's starting point)"
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="score every pair under the reference once, before the first step (kept in the run folder), "
        "then free the reference: each step and evaluation runs the policy alone",
    )


class DPOTrainerConfig(EpochTrainerConfig):
    """The ``trainer`` section of a DPO run (``hf dpo train``)."""

    experiment_name: str = "dpo"


class DPOTrainingConfig(_OneGroupRun):
    """A DPO run (``hf dpo train``): the causal LM ``model.path`` trained on preference pairs (``data``: the layout
    ``hf rm train`` reads) with the ``dpo`` section's loss against a frozen reference."""

    COMMAND: ClassVar[str] = "hf dpo train"
    ROWS: ClassVar[str] = "pairs"
    model: PolicyModelConfig = Field(default_factory=PolicyModelConfig)
    data: PreferenceDataConfig
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-6))
    trainer: DPOTrainerConfig = Field(default_factory=DPOTrainerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
