"""Streaming generation on a vLLM engine: samples, not batches, and generations that continue across a weight push.

`StreamingGenerator` keeps a set of admitted prompts generating on the engine of `hybridflow.engine.rollout.vllm`
between calls, one vLLM request per sample, and hands over whole groups (the ``rollout.n`` samples of a prompt) as
they finish, in any order. Every sampled token records the weight version (actor updates) that sampled it.

At a weight push (`StreamingGenerator.pause`, then the engine loads, then `StreamingGenerator.resume`):

- ``rollout.partial_rollout: true`` (AReaL's interruptible rollout, verl's fully-async ``partial_rollout``): the
  requests in flight are aborted, each sample keeping its tokens so far; after the load each continues from the same
  tokens under the new weights, as a new request whose prompt is its prompt and its tokens so far (the engine
  recomputes their keys and values with the new weights: no key or value of the old weights is reused, AReaL
  §4.2). Its remaining tokens record the new version.
- ``false``: the requests in flight finish under the old weights first (the engine drains), so every sample's tokens
  are of one version; only then the engine loads.

Each request is seeded with `hybridflow.engine.rollout.hf.sampling_seed` of its sample's row, as
`VLLMRollout.generate_sequences` seeds it, and a continuation with the seed of its row and segment: a sample's
tokens do not depend on how the engine batches requests, and a generator restored from `state_dict` continues
exactly where the saved one was.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.admission import StreamAdmission
from hybridflow.engine.rollout.hf import assemble_rollout, expand_prompts, sampling_seed
from hybridflow.engine.rollout.vllm import VLLMRollout, eager_on_cpu


@dataclass
class StreamSample:
    """One sample in the stream: the `row`-th of the stream `stream`'s iteration `global_steps` (its seed's key),
    its prompt's ids, and what it has sampled so far: ids, the engine's log-prob of each (after temperature) and the
    weight version that sampled each. `segments`: the requests it has had (one more after each interrupt);
    `prompt_width`: the width its prompt batch was padded to (the hand-over pads to the widest of its samples').
    `key`: what its seeds' stream name adds to the generator's (an agent turn's ``"/turn<k>"``); `max_tokens`: its
    budget in tokens (0: ``rollout.response_length``)."""

    uid: str
    row: int
    global_steps: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    done: bool = False
    prompt_width: int = 0
    key: str = ""
    max_tokens: int = 0

    @property
    def oldest_version(self) -> int | None:
        """The version of its first token (the staleness bound's), None before it has one."""
        return self.versions[0] if self.versions else None


@dataclass
class StreamGroup:
    """The samples of one prompt (its ``uid``), admitted at weight version `admitted`, with their non-tensor columns
    (``data_source``, ``reward_model``, ...) as the rollout's batch carries them."""

    uid: str
    admitted: int
    samples: list[StreamSample]
    columns: dict[str, list[Any]]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


class StreamingGenerator:
    """Admitted prompts generating on `engine` across calls (see the module docstring).

    Args:
        engine: the rollout's vLLM engine (its ``llm``, sampling parameters, adapter and EOS ids).
        partial_rollout: interrupt the requests in flight at a weight push and continue them under the new weights
            (``rollout.partial_rollout``); False: let them finish under the old weights first.
        version: the weight version the engine serves now.
        temperature: the sampling temperature (``rollout.temperature``).
        stream: the random stream's name (``"train"``): samples of different streams never share seeds.
        admission: the staleness bound's bookkeeping (`StreamAdmission`): `admit` refuses prompts beyond its room,
            and `next_batch` hands over the groups it picks. None: no bound (`take` any finished groups).
    """

    def __init__(
        self,
        engine: VLLMRollout,
        partial_rollout: bool = True,
        version: int = 0,
        temperature: float | None = None,
        stream: str = "train",
        admission: StreamAdmission | None = None,
    ):
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.partial_rollout = partial_rollout
        self.version = version
        self.temperature = engine.config.temperature if temperature is None else temperature
        self.stream = stream
        self.admission = admission
        self.groups: dict[str, StreamGroup] = {}  # admitted and not taken, in admission order
        self._requests: dict[str, StreamSample] = {}  # in flight: vLLM request id -> sample
        self._pending: list[StreamSample] = []  # unfinished, waiting for `resume` to be sent to the engine
        self._paused = False
        self._delta = RequestOutputKind.DELTA
        self.busy_s = 0.0  # seconds spent in engine steps, all told
        self.interrupted = 0  # samples aborted mid-generation by `pause` (partial rollouts), all told

    # ------------------------------------------------------------------ admission
    def admit(self, prompts: DataProto) -> list[str]:
        """Start generating ``rollout.n`` samples of every prompt of `prompts` (left-padded ``input_ids`` and
        ``attention_mask`` int64 [B, P], ``meta_info["global_steps"]`` and ``"row_offset"`` as for
        `VLLMRollout.generate_sequences`, whose seeds each sample gets). Returns the groups' uids.

        Raises:
            ValueError: a prompt's uid is already in the stream (admitted twice), or more prompts than the
                `admission`'s room (nothing admitted then).
        """
        n = self.engine.config.n
        global_steps = int(prompts.meta_info.get("global_steps", 0))
        row_offset = int(prompts.meta_info.get("row_offset", 0))
        batch = expand_prompts(prompts, n, self.stream)
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        uids = [str(batch.non_tensor_batch["uid"][g * n]) for g in range(len(prompts))]
        twice = [u for u in uids if u in self.groups]
        if twice:
            raise ValueError(f"prompts admitted twice to the stream: {twice}")
        if self.admission is not None:
            self.admission.admit(uids, self.version)
        for g, uid in enumerate(uids):
            rows = range(g * n, (g + 1) * n)
            columns = {k: [v[i] for i in rows] for k, v in batch.non_tensor_batch.items()}
            members = [
                self._member(uid, row_offset * n + i, global_steps, ids[i][mask[i].bool()].tolist(), ids.shape[1])
                for i in rows
            ]
            self.groups[uid] = StreamGroup(uid, self.version, members, columns)
            self._started(self.groups[uid])
        return uids

    def _member(self, uid: str, row: int, global_steps: int, prompt_ids: list[int], width: int) -> Any:
        """One sample of a new group: here a `StreamSample`, one request (an agent stream's: a trajectory)."""
        return StreamSample(uid, row, global_steps, prompt_ids, prompt_width=width)

    def _started(self, group: StreamGroup) -> None:
        """A new (or restored) group's samples start: each unfinished one sends its request."""
        for sample in group.samples:
            if not sample.done:
                self._start(sample)

    def _start(self, sample: StreamSample) -> None:
        """Send `sample`'s next segment to the engine now, or at `resume` while paused."""
        if self._paused:
            self._pending.append(sample)
        else:
            self._submit(sample)

    def _submit(self, sample: StreamSample) -> None:
        """Send `sample`'s next segment to the engine: its prompt and tokens so far, for what remains of its budget,
        seeded by its row, key and segment."""
        name = self.stream + sample.key
        stream = name if sample.segments == 0 else f"{name}/continued-{sample.segments}"
        seed = sampling_seed(self.engine.seed, sample.global_steps, stream, sample.row)
        remaining = (sample.max_tokens or self.engine.config.response_length) - len(sample.ids)
        params = self.engine._sampling_params(self.temperature, remaining, seed, self.stream)
        params.output_kind = self._delta
        request_id = f"{sample.uid}/{sample.row}{sample.key}/{sample.segments}"
        prompt = self.engine._vllm.inputs.TokensPrompt(prompt_token_ids=sample.prompt_ids + sample.ids)
        self.engine.llm.llm_engine.add_request(request_id, prompt, params, lora_request=self.engine._lora_request)
        self._requests[request_id] = sample
        sample.segments += 1

    # ------------------------------------------------------------------ generation
    @property
    def in_flight(self) -> int:
        """Requests generating now (one per sample)."""
        return len(self._requests)

    @property
    def working(self) -> bool:
        """Whether `step` makes progress: requests are in flight."""
        return bool(self._requests)

    def step(self) -> None:
        """One engine step: every request in flight samples its next token (or its prompt is prefilled); its
        seconds add to `busy_s`."""
        if not self._requests:
            return
        started = time.perf_counter()
        with eager_on_cpu(self.engine.on_gpu):
            outputs = self.engine.llm.llm_engine.step()
        self.busy_s += time.perf_counter() - started
        for out in outputs:
            sample = self._requests[out.request_id]
            delta = out.outputs[0]
            ids = list(delta.token_ids)
            log_probs = [entry[t].logprob for t, entry in zip(ids, delta.logprobs or [], strict=False)]
            sample.ids += ids
            sample.log_probs += log_probs + [0.0] * (len(ids) - len(log_probs))
            sample.versions += [self.version] * len(ids)
            if out.finished:
                sample.done = True
                del self._requests[out.request_id]
                self._answered(sample)

    def _answered(self, sample: StreamSample) -> None:
        """`sample`'s request has finished (here: the sample has; the admission hears of its group once whole)."""
        self._group_progress(sample.uid)

    def _group_progress(self, uid: str) -> None:
        """Tell the admission that group `uid` has finished, once it has."""
        if self.admission is not None and self.groups[uid].done:
            self.admission.finish([uid])

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step while requests are in flight, until `until()` holds (checked before every step; None: until none
        is in flight)."""
        while self._requests and not (until is not None and until()):
            self.step()

    def finished(self) -> list[StreamGroup]:
        """The groups whose every sample has finished, in admission order."""
        return [g for g in self.groups.values() if g.done]

    # ------------------------------------------------------------------ weight pushes
    def pause(self) -> None:
        """Before the engine loads new weights: with partial rollouts, abort the requests in flight (each sample
        keeps its tokens); without, let them finish under the weights that began them. Admissions wait for
        `resume`."""
        self._paused = True  # requests made from now on (an agent's next turn) wait for `resume`
        if self.partial_rollout:
            self.engine.llm.llm_engine.abort_request(list(self._requests))
            self.interrupted += len(self._requests)
            self._pending += self._requests.values()
            self._requests.clear()
        else:
            self.run()

    def resume(self, version: int) -> None:
        """After the engine has loaded weight `version`: every unfinished sample continues from its tokens so far,
        its new tokens recording `version`."""
        self.version = version
        self._paused = False
        pending, self._pending = self._pending, []
        for sample in pending:
            self._submit(sample)

    # ------------------------------------------------------------------ hand-over
    def take(self, uids: list[str]) -> DataProto:
        """Remove the finished groups `uids` from the stream and return their samples as the rollout's batch, in
        `uids`' order: the layout of `VLLMRollout.generate_sequences` (prompts left-padded to the widest of their
        batches: the sampler pads every batch to the dataset's longest prompt when streaming, so the shares of several
        engines join),
        plus ``rollout_token_versions`` int64 [B, T] (the version that sampled each response token; -1 past its
        end) and ``rollout_version`` int64 [B] (that of the row's oldest token).

        Raises:
            ValueError: no uid, a uid not in the stream, or one whose samples have not all finished.
        """
        missing = [u for u in uids if u not in self.groups or not self.groups[u].done]
        if not uids or missing:
            raise ValueError(f"take needs finished groups of the stream; not finished or not in it: {missing or uids}")
        return self._assemble([self.groups.pop(u) for u in uids])

    def _assemble(self, groups: list[StreamGroup]) -> DataProto:
        """The batch of finished `groups` (`take`'s layout)."""
        samples = [s for g in groups for s in g.samples]
        length, pad = self.engine.config.response_length, self.engine.tokenizer.pad_token_id
        width = max(max(len(s.prompt_ids), s.prompt_width) for s in samples)
        prompt_ids = torch.full((len(samples), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(samples), width), dtype=torch.long)
        responses = torch.full((len(samples), length), pad, dtype=torch.long)
        log_probs = torch.zeros((len(samples), length), dtype=torch.float32)
        versions = torch.full((len(samples), length), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            prompt_ids[i, width - len(s.prompt_ids) :] = torch.tensor(s.prompt_ids)
            prompt_mask[i, width - len(s.prompt_ids) :] = 1
            t = min(len(s.ids), length)
            responses[i, :t] = torch.tensor(s.ids[:t], dtype=torch.long)
            log_probs[i, :t] = torch.tensor(s.log_probs[:t])
            versions[i, :t] = torch.tensor(s.versions[:t])
        tensors = assemble_rollout(prompt_ids, prompt_mask, responses, self.engine.eos_token_ids, pad, length)
        mask = tensors["response_mask"]
        tensors["rollout_log_probs"] = log_probs * mask
        tensors["rollout_token_versions"] = torch.where(mask.bool(), versions, -1)
        tensors["rollout_version"] = torch.tensor([s.oldest_version for s in samples], dtype=torch.long)
        columns = {k: [v for g in groups for v in g.columns[k]] for k in groups[0].columns}
        return DataProto.from_dict(tensors, columns, {"temperature": self.temperature})

    def next_batch(self) -> DataProto | None:
        """The next training batch the `admission` picks (`StreamAdmission.next_batch`), taken (`take`); None while
        it waits for more groups to finish.

        Raises:
            RuntimeError: the stream has no `admission`.
        """
        if self.admission is None:
            raise RuntimeError("next_batch needs a stream with admission control (StreamingGenerator(admission=...))")
        uids = self.admission.next_batch()
        return None if uids is None else self.take(uids)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every group in the stream, finished or not, with its samples' tokens, log-probs and versions so far (JSON
        types): what `load_state_dict` continues from. Taken between calls, when nothing is mid-step."""
        return {
            "version": self.version,
            "admission": None if self.admission is None else self.admission.state_dict(),
            "groups": [
                {
                    "uid": g.uid,
                    "admitted": g.admitted,
                    "samples": [self._saved(s) for s in g.samples],
                    "columns": {k: _plain(v) for k, v in g.columns.items()},
                }
                for g in self.groups.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any], paused: bool = False) -> None:
        """Continue the stream `state_dict` saved (its in-flight requests lost with the old process): every
        unfinished sample is sent to the engine again from its tokens so far, seeded by its next segment; with
        `paused`, at the next `resume` (once the engine has loaded the weights to continue with).

        Raises:
            RuntimeError: the stream is not empty.
        """
        if self.groups:
            raise RuntimeError("load_state_dict needs an empty stream")
        state = copy.deepcopy(state)  # its samples' lists grow here
        self.version = int(state["version"])
        if self.admission is not None and state.get("admission") is not None:
            self.admission.load_state_dict(state["admission"])
        self._paused = True  # whatever restarts, starts at `resume`
        for g in state["groups"]:
            samples = [self._restored(s) for s in g["samples"]]
            group = StreamGroup(g["uid"], int(g["admitted"]), samples, dict(g["columns"]))
            self.groups[g["uid"]] = group
            self._started(group)
        if not paused:
            self.resume(self.version)

    def _saved(self, sample: StreamSample) -> dict[str, Any]:
        """A group member as `state_dict` saves it (JSON types)."""
        return asdict(sample)

    def _restored(self, saved: dict[str, Any]) -> StreamSample:
        """A group member from what `_saved` wrote."""
        return StreamSample(**saved)


def _plain(values: list[Any]) -> list[Any]:
    """Column values as JSON types (numpy scalars and arrays to Python ones)."""
    return [v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v for v in values]
