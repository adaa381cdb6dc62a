"""Admission control for a streaming rollout: which prompts the stream may start, and which of its finished groups
make the next training batch, so that no trained sample is more than ``rollout.max_staleness`` updates old and no
sample is ever dropped.

A group (the ``rollout.n`` samples of one prompt) admitted while the engine serves weight version ``a`` samples
every token at version ``a`` or later, so if it is trained by the actor at version ``t`` (the ``t``-th batch,
after ``t`` updates), the staleness of its oldest token is at most ``t - a``. Its *deadline* is ``a + s``
(``s`` = ``rollout.max_staleness``): the last batch it may join. Every batch holds ``B`` groups
(``data.train_batch_size`` prompts), so the untrained groups can all meet their deadlines exactly when, for every
deadline ``d`` from the next batch ``t`` on, at most ``(d - t + 1) * B`` of them are due by ``d`` (the
earliest-deadline-first test of a unit-time schedule). `StreamAdmission` keeps that true:

- **Admission** (`StreamAdmission.room`): a new group has the latest deadline, so it fits while the groups
  admitted so far number at most ``(a + s + 1) * B`` (AReaL's rule, ``max_head_offpolicyness``, there counted in
  samples: the count is the same bound).
- **Hand-over** (`StreamAdmission.next_batch`): the next batch is the first ``B`` finished groups in admission
  order (earliest deadlines first), taken as soon as they exist and the groups left behind still pass the test
  (else it waits for older groups to finish: the long tail can be passed over only while slack remains).

What streaming gains under this bound: every admitted group generates at once on the engine, so the long tail
of the oldest groups overlaps the bulk of the younger ones instead of idling the engine at the end of each batch
(the batch modes generate one batch per call). Which groups a batch takes is free only within the slack the bound
leaves: with the stream admitting up to its room and the engine taking every push, the untrained groups form
``s + 1`` layers of ``B`` by admission version and batch ``t`` must take the layer due at ``t``; groups are passed
over when the layers are not full (the first ``s + 1`` batches, pushes every ``trainer.weight_sync_every > 1``
updates, the run's end).

Why this keeps the trained samples unbiased by length: prompts are admitted in the sampler's order whatever their
responses' lengths, no group is dropped or truncated, and each is trained within ``s`` batches of its admission,
so a prompt whose responses are long is trained as surely as one whose responses are short, at most ``s`` batches
later. Over any window of batches the trained prompts are the admitted ones; only their order within ``s``
batches follows their lengths. Groups stay whole (a group is handed over once all its samples have finished), as
the group-relative estimators (GRPO, RLOO) need.
"""

from __future__ import annotations

from typing import Any


class StreamAdmission:
    """The bookkeeping of admission control (see the module docstring); holds no samples, only group uids.

    Args:
        batch_groups: groups per training batch (``data.train_batch_size`` prompts), B.
        max_staleness: ``rollout.max_staleness``, s: how many updates the actor may be ahead of the weights that
            sampled a trained sample's oldest token.
        total_groups: the groups the run trains in all (``trainer.total_iterations * B``): none is admitted beyond.

    Raises:
        ValueError: `batch_groups` < 1, `max_staleness` < 0 or `total_groups` < 0.
    """

    def __init__(self, batch_groups: int, max_staleness: int, total_groups: int):
        if batch_groups < 1 or max_staleness < 0 or total_groups < 0:
            raise ValueError(
                f"StreamAdmission needs batch_groups >= 1 (data.train_batch_size), max_staleness >= 0 "
                f"(rollout.max_staleness) and total_groups >= 0; got {batch_groups}, {max_staleness}, {total_groups}"
            )
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.total_groups = total_groups
        self.trained = 0  # batches handed over: the actor version that trains the next one
        self.admitted_total = 0  # every group ever admitted, trained or not
        self.admitted: dict[str, int] = {}  # untrained groups, in admission order -> the version they were admitted at
        self.finished: set[str] = set()  # untrained groups whose samples have all finished

    def room(self, version: int) -> int:
        """How many groups may be admitted now, the engine serving weight `version`: ``min((version + s + 1) * B,
        total_groups) - admitted_total``, never below 0."""
        bound = min((version + self.max_staleness + 1) * self.batch_groups, self.total_groups)
        return max(0, bound - self.admitted_total)

    def admit(self, uids: list[str], version: int) -> None:
        """Record that the groups `uids` start generating under weight `version`, in this order.

        Raises:
            ValueError: more groups than `room` allows, a uid already in the stream, or a `version` below that of
                an earlier admission (weight versions only grow).
        """
        fits = self.room(version)
        if len(uids) > fits:
            raise ValueError(
                f"{len(uids)} groups admitted at weight version {version}, but only {fits} fit within "
                f"rollout.max_staleness={self.max_staleness} ({self.admitted_total} admitted, batches of "
                f"{self.batch_groups})"
            )
        twice = [u for u in uids if u in self.admitted] + [u for i, u in enumerate(uids) if u in uids[:i]]
        if twice:
            raise ValueError(f"groups admitted twice to the stream: {twice}")
        if self.admitted and version < max(self.admitted.values()):
            raise ValueError(f"admission at weight version {version} after one at {max(self.admitted.values())}")
        for uid in uids:
            self.admitted[uid] = version
        self.admitted_total += len(uids)

    def finish(self, uids: list[str]) -> None:
        """Record that every sample of the groups `uids` has finished.

        Raises:
            KeyError: a uid not admitted, or already trained.
        """
        unknown = [u for u in uids if u not in self.admitted]
        if unknown:
            raise KeyError(f"groups finished that are not in the stream: {unknown}")
        self.finished.update(uids)

    @property
    def done(self) -> bool:
        """Every group of the run has been handed over."""
        return self.trained * self.batch_groups >= self.total_groups

    def deadline(self, uid: str) -> int:
        """The last batch (actor version) the untrained group `uid` may be trained in: its admission version + s."""
        return self.admitted[uid] + self.max_staleness

    def next_batch(self) -> list[str] | None:
        """The uids of the next training batch, in admission order, removed from the stream (the actor version
        that trains them is the old `trained`, which grows by one); None while it must wait for more groups to
        finish: fewer than B are finished (fewer only for the run's last batch), or taking them would leave older
        groups unable to meet their deadlines."""
        size = min(self.batch_groups, self.total_groups - self.trained * self.batch_groups)
        if size <= 0:
            return None
        chosen = [u for u in self.admitted if u in self.finished][:size]
        if len(chosen) < size or not self._feasible(set(chosen)):
            return None
        for uid in chosen:
            del self.admitted[uid]
            self.finished.discard(uid)
        self.trained += 1
        return chosen

    def _feasible(self, chosen: set[str]) -> bool:
        """Whether the untrained groups left after batch `trained` takes `chosen` can all meet their deadlines:
        for every deadline d, at most ``(d - trained) * B`` of them are due by d."""
        deadlines = [self.deadline(u) for u in self.admitted if u not in chosen]  # non-decreasing
        return all(left <= (d - self.trained) * self.batch_groups for left, d in enumerate(deadlines, start=1))

    def state_dict(self) -> dict[str, Any]:
        """The bookkeeping as JSON types, for the checkpoint beside the stream's samples."""
        return {
            "batch_groups": self.batch_groups,
            "trained": self.trained,
            "admitted_total": self.admitted_total,
            "admitted": list(self.admitted.items()),
            "finished": [u for u in self.admitted if u in self.finished],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s bookkeeping."""
        self.trained = int(state["trained"])
        self.admitted_total = int(state["admitted_total"])
        self.admitted = {str(u): int(v) for u, v in state["admitted"]}
        self.finished = set(state["finished"])
