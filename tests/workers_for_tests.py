"""A small worker class for the worker-group tests (loaded by the worker processes as 'path.py:ToyWorker')."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.transfer import Dispatch, register


class ToyWorker:
    def __init__(self, rank: int, world_size: int, data_dir: str, marker_dir: str | None = None):
        self.rank, self.world_size = rank, world_size
        self.marker_dir = Path(marker_dir) if marker_dir else None
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        self.calls += 1
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid()}

    @register(Dispatch.ONE_TO_ALL)
    def slurm_env(self) -> dict:
        keys = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_CPUS_PER_TASK", "MASTER_ADDR", "SLURMD_NODENAME")
        return {k: os.environ.get(k) for k in keys}

    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.ONE_TO_ALL)
    def process_view(self, variable: str) -> dict:
        """What this rank's process sees of its start (the local fork server's tests); prints a line to stdout."""
        print(f"rank {self.rank} says hello on stdout")
        return {
            "variable": os.environ.get(variable),
            "cwd": os.getcwd(),
            "parent": os.getppid(),
            "engine_imported": "hybridflow.engine.worker" in sys.modules,  # this module never imports it
            "vllm_engine_imported": "vllm.entrypoints.llm" in sys.modules,  # nor vLLM
        }

    @register(Dispatch.ONE_TO_ALL)
    def network_view(self) -> dict:
        """This rank's host name, the address it listens on (`HOST_ADDRESS_ENV`) and gloo's interface setting."""
        import socket

        from hybridflow.engine.rollout.broadcast import HOST_ADDRESS_ENV

        return {
            "host": socket.gethostname(),
            "address": os.environ.get(HOST_ADDRESS_ENV),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }

    @register(Dispatch.RANK_ZERO)
    def all_reduce(self, x: float) -> float:
        t = torch.tensor([x * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t)

    @register(Dispatch.ONE_TO_ALL)
    def reduce_for(self, seconds: float) -> int:
        """All-reduce in a loop for `seconds` (a collective in flight, as in update_actor); returns the rounds."""
        rounds, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            dist.all_reduce(torch.ones(1024))
            rounds += 1
        return rounds

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto, factor: int = 2, key: str = "x") -> DataProto:
        n = len(data)
        return DataProto.from_dict(
            {"y": data.batch[key] * factor, "rank": torch.full((n,), self.rank)}, {"tag": [f"r{self.rank}"] * n}
        )

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, v: int) -> int:
        return v * 10 + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def touch(self, name: str) -> bool:
        self.calls += 1
        (self.marker_dir / f"{name}-{self.rank}").write_text("executed")
        return True

    @register(Dispatch.ONE_TO_ALL)
    def call_count(self) -> int:
        return self.calls

    @register(Dispatch.ONE_TO_ALL)
    def crash(self) -> None:
        raise ValueError(f"boom on rank {self.rank}")

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def not_registered(self) -> str:
        return "must not be callable from the controller"
