"""The run store's vocabularies and limits: run kinds and statuses, roles, executors, lease timing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
"""Alembic's script folder (env.py, script.py.mako, versions/); shipped as package data, loaded by path."""

RUN_KINDS = ("rl", "rm", "sft", "dpo")
"""What a run trains: ``rl`` a policy (``hf run``, flow ``hybridflow-rlhf``), ``rm`` a reward model (``hf rm train``,
flow ``hybridflow-rm``), ``sft`` a policy by supervised fine-tuning (``hf sft train``, flow ``hybridflow-sft``),
``dpo`` a policy on preference pairs (``hf dpo train``, flow ``hybridflow-dpo``)."""
RUN_STATUSES = ("pending", "running", "completed", "failed", "interrupted")
FINAL_STATUSES = ("completed", "failed", "interrupted")
ROLES = ("actor", "rollout", "ref", "critic", "reward", "reward_model", "teacher")
EXECUTORS = ("local", "slurm")
SAMPLE_KINDS = ("train", "val")
LEASE_TTL_S = 60.0
"""A controller renews its run's lease every `LEASE_RENEW_S` seconds; a lease whose last heartbeat is older than this
(or, on the same host, whose process is gone) is stale: its controller crashed, and another may take the run over."""
LEASE_RENEW_S = 10.0
SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite writer waits for another process's write lock before failing, in seconds."""

_NAME_MAX = 255
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_PG_MIGRATION_LOCK = 0x6866_5275_6E53_746F  # "hfRunSto": the advisory lock key serialising migrations
_WRITE_OPTION = "hybridflow_write"  # execution option marking the engine whose transactions write
