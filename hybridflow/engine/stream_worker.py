"""The streaming rollout's side of a worker (``rollout.streaming``): `StreamingRollout`, the methods an
`hybridflow.engine.worker.RLHFWorker` hosting the rollout streams with.

The stream (`hybridflow.engine.rollout.streaming.StreamingGenerator`, or an agent stream:
`hybridflow.engine.agent.streaming.AgentStream`) is made at the first stream call, with admission control of this
engine's share of each batch; prompts join it through `StreamingRollout.stream_admit`, each iteration takes its
batch through `StreamingRollout.stream_batch`, the rank loop steps it between calls
(`StreamingRollout.background_step`, `hybridflow.slurm.rank`), a push or a validation pauses it
(`StreamingRollout._pause_stream`, `_resume_stream`) and a checkpoint holds it (``<AHEAD_DIR>/stream-<rank>.json``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hybridflow.engine.checkpoint import AHEAD_DIR, STREAM_FILE
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.lockstep import Lockstep
from hybridflow.engine.rollout.streaming import StreamingGenerator
from hybridflow.engine.transfer import Dispatch, register


class StreamingRollout:
    """The stream methods of a worker (module docstring). The worker has ``config``, ``rank``, ``world_size``,
    ``rollout``, ``rollout_version``, ``mesh_coords``, ``_need``; it calls `_init_stream` in its constructor."""

    def _init_stream(self) -> None:
        self.stream: StreamingGenerator | None = None  # the prompts generating across calls
        self._stream_clock = (0.0, 0.0)  # (time.perf_counter(), stream.busy_s) at the last push
        self._stream_error: Exception | None = None  # raised by a background step: the next stream call raises it
        self._lockstep: Lockstep | None = None  # a stream on an engine over several ranks: their background steps

    def _pause_stream(self) -> dict[str, float]:
        """Before a push: the stream's engine metrics since the last push (`_stream_metrics`) and
        ``rollout/stream_interrupted``; the samples in flight interrupted (partial rollouts) or finished first.
        Nothing without a stream."""
        if self.stream is None:
            return {}
        interrupted, streamed = self.stream.interrupted, self._stream_metrics()
        self.stream.pause()
        streamed["rollout/stream_interrupted"] = float(self.stream.interrupted - interrupted)
        return streamed

    def _resume_stream(self, version: int) -> None:
        """After a push (or a validation): every unfinished sample continues, its new tokens recording `version`."""
        if self.stream is not None:
            self.stream.resume(version)

    def _save_stream(self, staging: str) -> list[str]:
        """This engine's stream (its share of the prompts) into a checkpoint's staging folder: ``["stream"]``, or
        nothing without a stream."""
        if self.stream is None:
            return []
        (Path(staging) / AHEAD_DIR).mkdir(exist_ok=True)
        saved = Path(staging) / AHEAD_DIR / STREAM_FILE.format(rank=self.rank)
        saved.write_text(json.dumps(self.stream.state_dict()))
        return ["stream"]

    def _load_stream(self, path: str) -> None:
        """The stream checkpoint `path` holds for this rank, paused until the first push (the engine loads the
        restored weights first); nothing when it holds none."""
        saved = Path(path) / AHEAD_DIR / STREAM_FILE.format(rank=self.rank)
        if saved.exists():
            self._streaming().load_state_dict(json.loads(saved.read_text()), paused=True)

    def _stream_metrics(self) -> dict[str, float]:
        """The stream's engine since the last push (the previous call of this): ``rollout/stream_busy_s`` and
        ``rollout/stream_idle_s`` (seconds in and out of engine steps), ``rollout/stream_in_flight`` (samples
        generating now)."""
        now, (since, busy_before) = time.perf_counter(), self._stream_clock
        self._stream_clock = (now, self.stream.busy_s)
        busy = self.stream.busy_s - busy_before
        return {
            "rollout/stream_busy_s": busy,
            "rollout/stream_idle_s": max(0.0, now - since - busy),
            "rollout/stream_in_flight": float(self.stream.in_flight),
        }

    def _streaming(self) -> StreamingGenerator:
        """The stream of this rank's engine, made at its first use: admission control of its share of each batch
        (``data.train_batch_size`` / the rollout pool's engines groups), ``rollout.max_staleness`` and the run's
        ``trainer.total_iterations``; an engine over a block of ranks (``rollout.gen_tp`` > 1) streams the same
        share on each, their background steps in `Lockstep`."""
        from hybridflow.engine.rollout.admission import StreamAdmission

        self._need("rollout")
        if self._stream_error is not None:
            error, self._stream_error = self._stream_error, None
            raise RuntimeError(f"the stream's engine failed between calls: {error!r}") from error
        if self.stream is None:
            cfg = self.config
            coords = self.mesh_coords("generate")  # engines side by side, each over a block of ranks
            engines = coords[1] if coords is not None else self.world_size
            share = cfg.data.train_batch_size // engines  # the config checks it divides
            admission = StreamAdmission(share, cfg.max_staleness(), cfg.trainer.total_iterations * share)
            self.rollout.wake()  # generating from now on, between calls too
            if cfg.rollout.multi_turn.enable:  # agent loops: a trajectory's turns span pushes
                from hybridflow.engine.agent.streaming import AgentStream as Stream
            else:
                Stream = StreamingGenerator
            self.stream = Stream(self.rollout, cfg.rollout.partial_rollout, self.rollout_version, admission=admission)
            self._stream_clock = (time.perf_counter(), 0.0)
            block = getattr(self.rollout, "block", None)
            self._lockstep = Lockstep(block) if block is not None else None
        return self.stream

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="generate")
    def stream_admit(self, prompts: DataProto) -> None:
        """Start generating ``rollout.n`` samples of each prompt of `prompts` (left-padded ``input_ids`` and
        ``attention_mask`` int64 [B, P]) on the stream, under the weights the engine serves now; they generate
        between calls (`background_step`) until `stream_batch` hands them over.

        Raises:
            ValueError: more prompts than the staleness bound admits now (`StreamAdmission.room`), or a prompt
                admitted twice.
        """
        self._streaming().admit(prompts)

    @register(Dispatch.ONE_TO_ALL)
    def stream_batch(self) -> DataProto | None:
        """This engine's share of the next training batch of the stream: its ``data.train_batch_size`` / engines
        whole groups of ``rollout.n`` samples (`StreamAdmission.next_batch`), generating until they have finished
        (the stage joins the engines' shares in rank order: the batch's rows in the order of its prompts' shares).
        On the other ranks of an engine's block: the same batch taken, None returned (its first rank's is the
        engine's).
        The layout of `generate_sequences`, plus ``rollout_token_versions`` int64 [B*n, T] (the version that sampled
        each response token, -1 past its end); ``rollout_version`` int64 [B*n] is that of each row's oldest token.

        Raises:
            RuntimeError: nothing generates and no batch can be formed (fewer groups admitted than a batch).
        """
        stream = self._streaming()
        while (batch := stream.next_batch()) is None:  # on every rank of an engine's block alike
            if not stream.working:
                raise RuntimeError(
                    f"the stream holds {len(stream.groups)} groups, none generating, and no batch of "
                    f"{stream.admission.batch_groups} can be formed: admit prompts (stream_admit) first"
                )
            stream.step()
        return batch if self._lockstep is None or self._lockstep.block.is_leader else None

    def background_step(self) -> bool:
        """Between calls (`hybridflow.slurm.rank`): one engine step of the stream's samples in flight (an agent
        stream's loops run their tools then; on an engine over several ranks, the steps its first rank makes:
        `Lockstep.background`). Returns whether to look for the next call without waiting; an engine error stops
        the background steps and is raised by the next stream call (`stream_admit`, `stream_batch`), as that stage's
        failure."""
        if self.stream is None:
            return False
        working = self.stream.working and self._stream_error is None
        try:
            if self._lockstep is not None:
                return self._lockstep.background(working, self.stream.step)
            if working:
                self.stream.step()
        except Exception as error:  # the rank keeps serving calls; the stage that needs the stream fails
            self._stream_error = error
            return False
        return working

    def before_call(self) -> None:
        """A call has come (`hybridflow.slurm.rank`): on an engine over several ranks, their background steps stop
        (`Lockstep.before_call`)."""
        if self._lockstep is not None:
            self._lockstep.before_call()
