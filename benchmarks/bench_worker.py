"""The worker class of the worker-group benchmarks (loaded by the worker processes as ``path.py:BenchWorker``)."""

import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.transfer import Dispatch, register


class BenchWorker:
    def __init__(self, rank: int, world_size: int, data_dir: str):
        self.rank, self.world_size = rank, world_size

    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        """Nothing: the call's cost is the transfer protocol's and the channel's."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def produce(self, rows: DataProto, row_bytes: int) -> DataProto:
        """A batch of ``len(rows)`` rows of `row_bytes` bytes each (uint8 [n, row_bytes]), written where it runs."""
        n = len(rows)
        return DataProto.from_dict({"payload": torch.full((n, row_bytes), self.rank + 1, dtype=torch.uint8)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data: DataProto) -> dict:
        """Read this rank's rows (the load happens before the call) and report the bytes received."""
        payload = data.batch["payload"]
        return {"bytes": payload.numel() * payload.element_size(), "checksum": int(payload[:, 0].sum())}
