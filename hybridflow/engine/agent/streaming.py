"""Agent loops over a streaming rollout (``rollout.streaming`` with ``rollout.multi_turn.enable``): trajectories
whose turns span weight pushes, their tool state kept.

`AgentStream` is the `hybridflow.engine.rollout.streaming.StreamingGenerator` of an `AgentLoopRollout`: every
admitted row runs its agent loop as a task of one asyncio event loop that lives as long as the stream, and each of
the loop's engine calls (a turn) is one stream request, generating between calls with every other request of the
stream. A turn's request is seeded as `AgentLoopRollout` seeds it (``"<stream>/turn<k>"`` and the row), so at
staleness 0 the stream samples what the batch call samples.

At a weight push the turns in flight are paused as single-turn samples are (``rollout.partial_rollout``:
interrupted, continued from their tokens under the new weights; else finished first); the trajectories themselves
are never stopped: their loop objects, tool sessions (a code interpreter's process) and conversation so far stay in
the event loop, and their next turns sample with the new weights. Every model token records the version that
sampled it (``rollout_token_versions``; tool tokens -1), and the group's admission version bounds them all.

A checkpoint (`AgentStream.state_dict`) records, per trajectory, every engine call it made: the request's ids and
budget, and the answer's ids, log-probs and versions so far. A restored stream runs each trajectory's loop again
from its prompt: its calls are answered from the record while they ask what was recorded (the tools run again, so
a tool's state is rebuilt as it was), the call in flight continues from its saved tokens, and then the loop goes
on live. Nothing recorded is generated twice. A call that asks other ids than the record (a tool that answered
differently the second time) ends the replay there: from that turn on the trajectory samples anew (counted in
`AgentStream.diverged`).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybridflow.engine.agent.loop import AgentLoopOutput, SamplingParams
from hybridflow.engine.agent.rollout import AgentLoopRollout, trajectory
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.admission import StreamAdmission
from hybridflow.engine.rollout.streaming import StreamGroup, StreamingGenerator, StreamSample
from hybridflow.engine.rollout.tokens import TokenOutput, cut_at_eos

BUSY_WAIT_S = 0.002
"""Seconds a pump lets tools run while the engine has requests to step (the engine goes on after)."""
IDLE_WAIT_S = 0.05
"""Seconds a pump waits for tools when the engine has nothing to step (the rank then serves its calls again)."""


@dataclass
class StreamTrajectory:
    """One row's trajectory in the stream: the `row`-th of iteration `global_steps`, its prompt, its engine calls so
    far (`turns`: one `StreamSample` each, in order) and, once its loop has returned, its `output`. `replay`: a
    restored trajectory's recorded calls not yet asked again."""

    uid: str
    row: int
    global_steps: int
    prompt_ids: list[int]
    prompt_width: int
    turns: list[StreamSample] = field(default_factory=list)
    replay: list[StreamSample] = field(default_factory=list)
    output: AgentLoopOutput | None = None
    waiting: bool = False  # its loop waits for an engine answer

    @property
    def done(self) -> bool:
        return self.output is not None

    @property
    def oldest_version(self) -> int | None:
        """The version of its first model token."""
        versions = [t.oldest_version for t in self.turns if t.oldest_version is not None]
        return min(versions) if versions else None


class _TurnEngine:
    """A trajectory's `hybridflow.engine.agent.loop.TokenEngine`: each call one stream request."""

    def __init__(self, stream: AgentStream, trajectory: StreamTrajectory) -> None:
        self.stream, self.trajectory = stream, trajectory

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> TokenOutput:
        if max_tokens < 1:
            raise ValueError(
                f"row {self.trajectory.row} asked the engine for {max_tokens} tokens; an agent loop must ask >= 1"
            )
        return await self.stream._turn(self.trajectory, list(prompt_ids), int(max_tokens))


class AgentStream(StreamingGenerator):
    """Agent loops streaming on `agents`' vLLM engine (see the module docstring); the arguments of
    `StreamingGenerator`, with `agents` (the run's `AgentLoopRollout` on a `VLLMRollout`) for its engine."""

    def __init__(
        self,
        agents: AgentLoopRollout,
        partial_rollout: bool = True,
        version: int = 0,
        temperature: float | None = None,
        stream: str = "train",
        admission: StreamAdmission | None = None,
    ):
        super().__init__(agents.engine, partial_rollout, version, temperature, stream, admission)
        self.agents = agents
        self._loop = asyncio.new_event_loop()
        self._changed = asyncio.Event()  # a trajectory began waiting for the engine, or ended
        self._answers: dict[int, asyncio.Future] = {}  # id(turn) -> the future its loop awaits
        self._error: BaseException | None = None  # a loop's failure, raised by the next `step`
        self.replayed = 0  # engine calls answered from a checkpoint's record, all told
        self.diverged = 0  # restored trajectories whose replay asked other ids than the record

    # ------------------------------------------------------------------ trajectories
    def _member(self, uid: str, row: int, global_steps: int, prompt_ids: list[int], width: int) -> StreamTrajectory:
        return StreamTrajectory(uid, row, global_steps, prompt_ids, width)

    def _started(self, group: StreamGroup) -> None:
        """Every unfinished trajectory of `group` runs its loop (named by its ``agent_name`` column, else the
        default) as a task of the stream's event loop, with a tool session of its own."""
        names = self.agents.loop_names(group.columns.get("agent_name"), len(group.samples))
        params = SamplingParams(self.engine.config.response_length, self.temperature)
        for i, (run, loop_cls) in enumerate(zip(group.samples, self.agents.loops(names), strict=True)):
            if run.done:
                continue
            row = {key: column[i] for key, column in group.columns.items()}
            row["prompt_ids"] = list(run.prompt_ids)
            loop = loop_cls(self.agents.context(_TurnEngine(self, run)))
            task = self._loop.create_task(trajectory(loop, params, row))
            task.add_done_callback(lambda task, run=run: self._ended(run, task))

    def _ended(self, run: StreamTrajectory, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
        else:
            run.output = task.result()
            self._group_progress(run.uid)
        self._changed.set()

    async def _turn(self, run: StreamTrajectory, prompt_ids: list[int], max_tokens: int) -> TokenOutput:
        """The answer to `run`'s next engine call: from its record while the call asks what was recorded, else a
        new request of the stream."""
        turn = None
        if run.replay:
            recorded = run.replay.pop(0)
            if recorded.prompt_ids == prompt_ids and recorded.max_tokens == max_tokens:
                turn = recorded
            else:  # the loop asks otherwise than the saved one did: sample from here on
                run.replay.clear()
                self.diverged += 1
        if turn is None:
            key = f"/turn{len(run.turns)}"
            turn = StreamSample(run.uid, run.row, run.global_steps, prompt_ids, key=key, max_tokens=max_tokens)
        run.turns.append(turn)
        if turn.done:
            self.replayed += 1
        else:
            answer = self._answers[id(turn)] = self._loop.create_future()
            run.waiting = True
            self._changed.set()
            self._start(turn)
            try:
                await answer
            finally:
                run.waiting = False
        return cut_at_eos(turn.ids, turn.log_probs, set(self.engine.eos_token_ids), max_tokens)

    def _answered(self, sample: StreamSample) -> None:
        """A turn's request has finished: its loop gets the answer at the next pump."""
        self._answers.pop(id(sample)).set_result(None)

    # ------------------------------------------------------------------ generation
    def _runs(self) -> list[StreamTrajectory]:
        return [run for group in self.groups.values() for run in group.samples]

    def _busy(self) -> bool:
        """Whether a loop is neither finished nor waiting for the engine (it runs a tool, or has not started)."""
        return any(not run.done and not run.waiting for run in self._runs())

    @property
    def working(self) -> bool:
        """Whether `step` makes progress: requests are in flight, or loops run tools (or replay a record)."""
        return bool(self._requests) or self._busy()

    def step(self) -> None:
        """One engine step (when requests are in flight), then the loops run until each waits for the engine or
        has ended (at most `BUSY_WAIT_S` while the engine has requests, `IDLE_WAIT_S` else: a slow tool goes on at
        the next step).

        Raises:
            the first error of a loop (its trajectory is lost: the stage that needs it fails).
        """
        super().step()
        self._loop.run_until_complete(self._settle(BUSY_WAIT_S if self._requests else IDLE_WAIT_S))
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def _settle(self, timeout: float) -> None:
        deadline = self._loop.time() + timeout
        await asyncio.sleep(0)  # the loops whose answers came run to their next wait
        while self._busy() and self._error is None:
            self._changed.clear()
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return

    def run(self, until: Any = None) -> None:
        """Step while requests are in flight or loops run, until `until()` holds (None: until neither)."""
        while self.working and not (until is not None and until()):
            self.step()

    # ------------------------------------------------------------------ hand-over
    def _assemble(self, groups: list[StreamGroup]) -> DataProto:
        """The finished trajectories of `groups` as `AgentLoopRollout` lays them out, plus
        ``rollout_token_versions`` int64 [B, T] (each model token's version, -1 on tool tokens and past the end) and
        ``rollout_version`` int64 [B] (that of each row's oldest token)."""
        runs = [run for g in groups for run in g.samples]
        pad = self.engine.tokenizer.pad_token_id
        width = max(max(len(r.prompt_ids), r.prompt_width) for r in runs)
        input_ids = torch.full((len(runs), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(runs), width), dtype=torch.long)
        for i, run in enumerate(runs):
            input_ids[i, width - len(run.prompt_ids) :] = torch.tensor(run.prompt_ids)
            attention_mask[i, width - len(run.prompt_ids) :] = 1
        columns = {k: [v for g in groups for v in g.columns[k]] for k in groups[0].columns}
        rows = DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask}, columns)
        names = self.agents.loop_names(columns.get("agent_name"), len(runs))
        out = self.agents.assemble(rows, [run.output for run in runs], names)
        mask = out.batch["response_mask"].bool()
        versions = torch.full(mask.shape, -1, dtype=torch.long)
        for i, run in enumerate(runs):
            versions[i, mask[i]] = _model_token_versions(run, int(mask[i].sum()))
        out.batch["rollout_token_versions"] = versions
        out.batch["rollout_version"] = torch.tensor([run.oldest_version for run in runs], dtype=torch.long)
        out.meta_info["temperature"] = self.temperature
        return out

    # ------------------------------------------------------------------ checkpoints
    def _saved(self, run: StreamTrajectory) -> dict[str, Any]:
        """A trajectory as the checkpoint keeps it: its prompt and its engine calls (made, or still to replay)."""
        return {
            "uid": run.uid,
            "row": run.row,
            "global_steps": run.global_steps,
            "prompt_ids": run.prompt_ids,
            "prompt_width": run.prompt_width,
            "turns": [asdict(turn) for turn in [*run.turns, *run.replay]],
        }

    def _restored(self, saved: dict[str, Any]) -> StreamTrajectory:
        """A trajectory to run again from its prompt, its recorded calls to replay."""
        fields = {k: v for k, v in saved.items() if k != "turns"}
        return StreamTrajectory(**fields, replay=[StreamSample(**turn) for turn in saved["turns"]])

    def close(self) -> None:
        """Cancel the loops (their tools closed) and close the event loop."""
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()


def _model_token_versions(run: StreamTrajectory, tokens: int) -> torch.Tensor:
    """The version of each of `run`'s `tokens` model tokens (int64 [tokens]): its turns' answers in order, as the
    loop appended them verbatim; a loop that kept other model tokens gets its oldest version on every one (the
    staleness bound's, never newer than any token's)."""
    answered = [v for turn in run.turns for v in turn.versions]
    if len(answered) == tokens:
        return torch.tensor(answered, dtype=torch.long)
    return torch.full((tokens,), run.oldest_version if run.oldest_version is not None else -1, dtype=torch.long)
