"""How many bytes autograd keeps for the backward pass at its peak: what activation checkpointing reduces."""

from __future__ import annotations

import contextlib

import torch


class _Saved:
    """One tensor autograd saved; counted until autograd releases it (after its node's backward)."""

    def __init__(self, tensor: torch.Tensor, meter: PeakSavedBytes):
        self.tensor, self.meter, self.nbytes = tensor, meter, tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):
        self.meter.live -= self.nbytes


class PeakSavedBytes:
    """``with meter.watch(): loss.backward()...``: `peak` is the most bytes of saved tensors alive at once
    (counted per save, so a tensor saved twice counts twice, the same way with and without checkpointing)."""

    def __init__(self):
        self.live = self.peak = 0

    @contextlib.contextmanager
    def watch(self):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, self), lambda saved: saved.tensor):
            yield self
