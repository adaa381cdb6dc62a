"""Background steps of a stream whose vLLM engine spans a block of ranks (``rollout.gen_tp`` > 1 on a rollout pool of
its own): every rank of the block must step the engine the same number of times between two calls, since each step
is a collective over the block (vLLM's SPMD mode), but each rank's loop (`hybridflow.slurm.rank`) looks for calls on
its own clock.

`Lockstep` lets the block's first rank (the leader, `hybridflow.engine.rollout.vllm.EngineBlock`) decide: between
calls the other ranks wait for its word, and step when it says ``True``; it says ``False`` when it stops (nothing left
to step, or a call has come), and they go back to their calls. The calls themselves keep the ranks in step without a
word: each rank admits the same prompts (the block shares its rows), takes its batch after the same steps (the
engine samples the same tokens on every rank) and pauses at the same push.

Protocol, per rank loop: the leader's `Lockstep.background` sends one ``True`` per step, then one ``False``; its
`Lockstep.before_call` sends the ``False`` if it has not been sent; the others' `Lockstep.background` steps on every
``True`` and returns at the ``False``. A lockstep is made inside a call (with its stream), on every rank of the block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Lockstep:
    """The background steps of one engine block (see the module docstring).

    Args:
        block: this rank's `hybridflow.engine.rollout.vllm.EngineBlock` (its ``send``, ``receive``, ``is_leader``).
    """

    def __init__(self, block: Any) -> None:
        self.block = block
        self.released = False  # the leader has said False since the last call: the others serve calls

    def background(self, working: bool, step: Callable[[], None]) -> bool:
        """Between calls: on the leader, one `step` (told to the others) while `working`, else the word to stop;
        on the others, every step the leader makes until it stops. Returns whether this rank stepped and should
        look for a call without waiting (the leader while working; never the others: they wait for their call).
        """
        if not self.block.is_leader:
            while self.block.receive():
                step()
            return False
        if self.released:
            return False
        if working:
            self.block.send(True)
            step()
            return True
        self.block.send(False)
        self.released = True
        return False

    def before_call(self) -> None:
        """A call has come to this rank: the leader tells the others to stop stepping (if it has not), and after
        the call they wait for its word again."""
        if self.block.is_leader and not self.released:
            self.block.send(False)
        self.released = False
