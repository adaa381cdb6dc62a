"""`AgentLoopRollout`: a batch of prompts through agent loops on a rollout engine, token-in-token-out
(``rollout.multi_turn.enable``).

Each row runs the loop its ``agent_name`` column names (else ``rollout.multi_turn.default_agent_loop``) as a
coroutine; whenever every unfinished loop waits for the engine, their requests go to the engine in one batched call
(`hybridflow.engine.rollout.tokens`), sorted by row, so a turn of the whole batch costs one engine pass and the
samples do not depend on how the loops interleave. The request of row r's k-th engine call is seeded with
`hybridflow.engine.rollout.hf.sampling_seed` of (``trainer.seed``, ``global_steps``, ``"<stream>/turn<k>"``, r's
index in the whole batch): like single-turn rollouts, the samples are a pure function of the step, the prompts and
the weights, and a resumed run samples what the uninterrupted one did.

Output: the layout of `hybridflow.engine.rollout.hf` (``prompts`` [B, P], ``responses`` [B, T] with
T = ``rollout.response_length``, ``input_ids``, ``attention_mask``, ``position_ids`` [B, P+T], ``response_mask``
[B, T]) where a response is the whole trajectory after the prompt: ``attention_mask`` is 1 on every real token
(model, tool and template ids), ``response_mask`` only on the model's own ids, so no loss, KL or entropy is computed
on tool tokens. Plus ``rollout_log_probs`` float32 [B, T] (the engine's, 0 on tool tokens), ``agent/num_turns``
int64 [B], and ``agent/tool_calls/<tool>`` and ``agent/tool_errors/<tool>`` int64 [B] for every tool of the run,
``malformed_call`` and ``unknown_tool`` (a name the run has no tool of: counted there, never as a column of its
own); the loop's ``extra`` reaches the score function as ``extra_info["agent"]``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.engine.agent.chat_format import ChatFormat
from hybridflow.engine.agent.environment import MALFORMED, EnvironmentLoop, ToolEnvironment
from hybridflow.engine.agent.loop import AgentContext, AgentLoopOutput, SamplingParams, agent_loop
from hybridflow.engine.agent.parsers import tool_parser
from hybridflow.engine.agent.tools import ToolBox, load_tools
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.imports import load_module
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import expand_prompts, rollout_tensors, sampling_seed
from hybridflow.engine.rollout.tokens import TokenOutput, TokenRequest

UNKNOWN = "unknown_tool"
"""The tool name under which calls of tools the run does not have are counted: the model picks names, the metrics'
names must not come from it."""


def run_tools(cfg: HybridFlowConfig) -> ToolBox:
    """The run's tools (``rollout.multi_turn.tool_config_path``; none without one), bounded as the config says.

    Raises:
        the errors of `hybridflow.engine.agent.tools.load_tools`.
    """
    multi_turn = cfg.rollout.multi_turn
    tools = load_tools(multi_turn.tool_config_path, multi_turn.tool_timeout_s) if multi_turn.tool_config_path else []
    return ToolBox(tools, multi_turn.max_tool_response_length, multi_turn.tool_response_truncate_side)


def prompt_tools(cfg: HybridFlowConfig) -> list[dict[str, Any]] | None:
    """The OpenAI function schemas the prompts offer: with ``rollout.multi_turn.enable``, the run's tools, or with
    ``data.verifiers`` its environment's; else None.

    Raises:
        the errors of `hybridflow.engine.agent.tools.load_tools` and of
        `hybridflow.engine.agent.verifiers_env.load_environment`.
    """
    if not cfg.rollout.multi_turn.enable:
        return None
    if cfg.data.verifiers is not None:
        from hybridflow.engine.agent.verifiers_env import load_environment, prompt_schemas

        return prompt_schemas(load_environment(cfg.data.verifiers.env_id, cfg.data.verifiers.env_args))
    return run_tools(cfg).schemas or None


def import_environments(cfg: HybridFlowConfig) -> None:
    """Import ``rollout.multi_turn.env_imports`` (where environments are registered), each once per process.

    Raises:
        FileNotFoundError, ImportError: naming the entry (`hybridflow.engine.imports.load_module`)."""
    for i, target in enumerate(cfg.rollout.multi_turn.env_imports):
        load_module(target, f"rollout.multi_turn.env_imports[{i}]")


def check_agent_rows(cfg: HybridFlowConfig, rows: list[dict[str, Any]], tokenizer: Any, eos_ids: list[int]) -> None:
    """Before a run: every ``agent_name`` of `rows` is a registered loop, and with tools the chat template is
    prefix-stable (`ChatFormat`).

    Raises:
        ValueError: naming the row's ``agent_name`` or the template.
    """
    import_environments(cfg)
    loops = {agent_loop(cfg.rollout.multi_turn.default_agent_loop, "rollout.multi_turn.default_agent_loop")}
    for i, row in enumerate(rows):
        if row.get("agent_name"):
            loops.add(agent_loop(str(row["agent_name"]), f"agent_name of prompt row {i}"))
    if run_tools(cfg).tools or any(_observes(loop) for loop in loops):
        ChatFormat(tokenizer, eos_ids)


@dataclass
class _Pending:
    row: int
    turn: int
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future


class _Batcher:
    """Collects the engine requests of all loops and serves them together once every live loop waits."""

    def __init__(self) -> None:
        self.pending: list[_Pending] = []
        self.changed = asyncio.Event()

    def engine(self, row: int) -> _RowEngine:
        return _RowEngine(self, row)


class _RowEngine:
    """One row's `hybridflow.engine.agent.loop.TokenEngine`: numbers its calls (the turn of each seed)."""

    def __init__(self, batcher: _Batcher, row: int) -> None:
        self.batcher, self.row, self.turn = batcher, row, 0

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> TokenOutput:
        if max_tokens < 1:
            raise ValueError(f"row {self.row} asked the engine for {max_tokens} tokens; an agent loop must ask >= 1")
        future = asyncio.get_running_loop().create_future()
        self.batcher.pending.append(_Pending(self.row, self.turn, list(prompt_ids), int(max_tokens), future))
        self.turn += 1
        self.batcher.changed.set()
        return await future


class AgentLoopRollout:
    """A rollout that runs agent loops on another rollout's engine (see the module docstring).

    Args:
        engine: the configured rollout (``hf`` or ``vllm``): anything with ``token_engine(temperature, stream)``,
            ``update_weights``, ``sleep``, ``wake`` and ``eos_token_ids`` (and ``load_weights`` in a rollout pool of
            its own).
        cfg: the run's config (``rollout``, ``trainer.seed``).
        tokenizer: the actor's tokenizer.

    Raises:
        ValueError: the default loop is unknown, or the chat template is not prefix-stable (`ChatFormat`); the
            errors of `run_tools`.
    """

    def __init__(self, engine: Any, cfg: HybridFlowConfig, tokenizer: Any) -> None:
        self.engine = engine
        self.config = cfg.rollout
        self.seed = int(cfg.trainer.seed)
        self.tokenizer = tokenizer
        multi_turn = cfg.rollout.multi_turn
        import_environments(cfg)
        agent_loop(multi_turn.default_agent_loop, "rollout.multi_turn.default_agent_loop")
        self.tools = run_tools(cfg)
        self.parser = tool_parser(multi_turn.format)
        self.chat_format = ChatFormat(tokenizer, list(engine.eos_token_ids)) if self.tools.tools else None
        names = [tool.name for tool in self.tools.tools]
        if cfg.data.verifiers is not None:  # its environment's tools, called through its ToolEnv
            names += [schema["function"]["name"] for schema in prompt_tools(cfg) or []]
        self.tool_names = [*names, MALFORMED, UNKNOWN]

    def update_weights(self) -> dict[str, float]:
        """The engine's (`hybridflow.engine.extensions.Rollout.update_weights`)."""
        return self.engine.update_weights()

    def load_weights(self, pairs: Any, actor_log_probs: torch.Tensor) -> dict[str, float]:
        """The engine's, in a rollout pool of its own (`hybridflow.engine.rollout.vllm.VLLMRollout.load_weights`):
        the loops of the next batch run on the weights the actor's pool published."""
        return self.engine.load_weights(pairs, actor_log_probs)

    def sleep(self) -> None:
        """The engine's."""
        self.engine.sleep()

    def wake(self) -> None:
        """The engine's."""
        self.engine.wake()

    def generate_sequences(
        self, prompts: DataProto, n: int | None = None, temperature: float | None = None, stream: str = "train"
    ) -> DataProto:
        """`n` trajectories per prompt (default ``rollout.n``), each prompt's adjacent and keeping its ``uid``, as
        `hybridflow.engine.rollout.hf.HFRollout.generate_sequences` (same arguments); the layout is in the module
        docstring.

        Raises:
            ValueError: an unknown ``agent_name``; a loop returned another prompt or more than
                ``rollout.response_length`` response ids, or mismatched lists (names the loop and the row).
        """
        n = self.config.n if n is None else n
        temperature = self.config.temperature if temperature is None else temperature
        global_steps = int(prompts.meta_info.get("global_steps", 0))
        first_row = int(prompts.meta_info.get("row_offset", 0)) * n
        batch = expand_prompts(prompts, n, stream)
        names = self.loop_names(batch.non_tensor_batch.get("agent_name"), len(batch))
        loops = self.loops(names)  # unknown names fail before any generation

        def seed(row: int, turn: int) -> int:
            return sampling_seed(self.seed, global_steps, f"{stream}/turn{turn}", first_row + row)

        block = getattr(self.engine, "block", None)  # a tensor-parallel engine's ranks (vLLM's EngineBlock)
        with self.engine.token_engine(temperature, stream) as serve:
            if block is None:
                outputs = asyncio.run(self._run(batch, loops, serve, seed, temperature))
            elif block.is_leader:
                outputs = self._lead(block, batch, loops, serve, seed, temperature)
            else:
                outputs = _follow(block, serve)
        out = self.assemble(batch, outputs, names)
        out.meta_info.update(prompts.meta_info)
        out.meta_info["temperature"] = temperature
        return out

    def loop_names(self, agent_names: Any, rows: int) -> list[str]:
        """The loop of each of `rows` rows: its ``agent_name`` (`agent_names`, a column or None), else
        ``rollout.multi_turn.default_agent_loop``."""
        default = self.config.multi_turn.default_agent_loop
        return [str(x) if x else default for x in (agent_names if agent_names is not None else [None] * rows)]

    def loops(self, names: list[str]) -> list[type]:
        """The loop classes of `names` (and the template's turn ids, made once a loop observes an environment).

        Raises:
            ValueError: an unknown name (`hybridflow.engine.agent.loop.agent_loop`); the template is not
                prefix-stable.
        """
        loops = [agent_loop(name) for name in names]
        if self.chat_format is None and any(_observes(loop) for loop in loops):
            self.chat_format = ChatFormat(self.tokenizer, list(self.engine.eos_token_ids))
        return loops

    def context(self, engine: Any) -> AgentContext:
        """What a trajectory's loop shares with the rollout, generating with `engine` (its `TokenEngine`); its own
        tool session."""
        multi_turn = self.config.multi_turn
        return AgentContext(
            engine,
            self.tokenizer,
            self.chat_format,
            self.tools.session(),
            self.parser,
            multi_turn.max_assistant_turns,
            multi_turn.max_user_turns,
            multi_turn.env_config,
            multi_turn.tool_timeout_s,
        )

    async def _run(self, batch: DataProto, loops: list, serve, seed, temperature: float) -> list[AgentLoopOutput]:
        batcher = _Batcher()
        params = SamplingParams(self.config.response_length, temperature)
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
        tasks = []
        for i, loop_cls in enumerate(loops):
            row = {key: column[i] for key, column in batch.non_tensor_batch.items()}
            row["prompt_ids"] = ids[i][mask[i]].tolist()
            task = asyncio.ensure_future(trajectory(loop_cls(self.context(batcher.engine(i))), params, row))
            task.add_done_callback(lambda _: batcher.changed.set())
            tasks.append(task)
        while True:
            while sum(t.done() for t in tasks) + len(batcher.pending) < len(tasks):
                batcher.changed.clear()
                await batcher.changed.wait()
            if not batcher.pending:
                break
            waiting = sorted(batcher.pending, key=lambda p: p.row)
            batcher.pending = []
            answers = serve([TokenRequest(p.prompt_ids, p.max_tokens, seed(p.row, p.turn)) for p in waiting])
            for p, answer in zip(waiting, answers, strict=True):
                p.future.set_result(answer)
        results = await asyncio.gather(*tasks, return_exceptions=True)  # every failure retrieved, the first raised
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        return results

    def _lead(
        self, block: Any, batch: DataProto, loops: list, serve, seed, temperature: float
    ) -> list[AgentLoopOutput]:
        """Run the loops on the first rank of a tensor-parallel engine's block: each batch of token requests is sent
        to the block's other ranks before the engine serves it (their engine shards must take the same calls), then
        the trajectories (the tools ran here only); a failure is sent too, so that no rank waits for calls that will
        not come."""

        def mirrored(requests: list[TokenRequest]) -> list[TokenOutput]:
            block.send(("serve", requests))
            return serve(requests)

        try:
            outputs = asyncio.run(self._run(batch, loops, mirrored, seed, temperature))
        except BaseException as e:
            block.send(("failed", f"{type(e).__name__}: {e}"))
            raise
        block.send(("done", outputs))
        return outputs

    def assemble(self, batch: DataProto, outputs: list[AgentLoopOutput], names: list[str]) -> DataProto:
        """The rollout's batch (the module docstring's layout) of the trajectories `outputs` of `batch`'s rows
        (left-padded ``input_ids``, ``attention_mask`` int64 [B, P] and the rows' columns), run by loops `names`.

        Raises:
            ValueError: a trajectory is not its row's (`_check_output`).
        """
        length, pad = self.config.response_length, self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        b = len(batch)
        responses = torch.full((b, length), pad, dtype=torch.long)
        response_mask = torch.zeros((b, length), dtype=torch.long)
        real = torch.zeros((b, length), dtype=torch.long)
        log_probs = torch.zeros((b, length), dtype=torch.float32)
        columns = {"agent/num_turns": torch.zeros(b, dtype=torch.long)}
        for name in self.tool_names:
            columns[f"agent/tool_calls/{name}"] = torch.zeros(b, dtype=torch.long)
            columns[f"agent/tool_errors/{name}"] = torch.zeros(b, dtype=torch.long)
        extra_infos = list(batch.non_tensor_batch.get("extra_info", [{}] * b))
        for i, out in enumerate(outputs):
            _check_output(out, prompt_ids[i][prompt_mask[i].bool()].tolist(), length, names[i], i)
            t = len(out.response_ids)
            responses[i, :t] = torch.tensor(out.response_ids, dtype=torch.long)
            response_mask[i, :t] = torch.tensor(out.response_mask, dtype=torch.long)
            real[i, :t] = 1
            log_probs[i, :t] = torch.tensor(out.response_logprobs, dtype=torch.float32)
            columns["agent/num_turns"][i] = out.num_turns
            for kind, counts in (("tool_calls", out.tool_calls), ("tool_errors", out.tool_errors)):
                for name, count in counts.items():  # every rank has the same columns: the run's names only
                    columns[f"agent/{kind}/{name if name in self.tool_names else UNKNOWN}"][i] += count
            if out.extra:
                extra_infos[i] = {**(extra_infos[i] or {}), "agent": out.extra}
        tensors = {
            **rollout_tensors(prompt_ids, prompt_mask, responses, response_mask, real),
            "rollout_log_probs": log_probs * response_mask,
            **columns,
        }
        non_tensors = dict(batch.non_tensor_batch)
        if "extra_info" in non_tensors:
            non_tensors["extra_info"] = np.array(extra_infos, dtype=object)
        return DataProto.from_dict(tensors, non_tensors, dict(batch.meta_info))


def _observes(loop: type) -> bool:
    """Whether `loop` runs an environment of the user's (its observations need the template's turn ids even in a
    run without tools): an `EnvironmentLoop` of another than `ToolEnvironment`, or a loop that says so (its
    ``observes``: a verifiers environment's)."""
    if getattr(loop, "observes", False):
        return True
    return issubclass(loop, EnvironmentLoop) and loop.environment is not ToolEnvironment


async def trajectory(loop: Any, params: SamplingParams, row: dict[str, Any]) -> AgentLoopOutput:
    """`loop`'s trajectory of `row`; its tools' instances (an interpreter, a sandbox) closed when it ends, however."""
    try:
        return await loop.run(params, **row)
    finally:
        await loop.context.tools.close()


def _follow(block: Any, serve) -> list[AgentLoopOutput]:
    """On a tensor-parallel engine's other ranks: serve the token requests the block's first rank sends
    (`AgentLoopRollout._lead`), until it sends the trajectories.

    Raises:
        RuntimeError: the first rank's loops failed (its error named)."""
    while True:
        kind, payload = block.receive()
        if kind == "serve":
            serve(payload)
        elif kind == "done":
            return payload
        else:
            raise RuntimeError(f"the agent loops failed on this engine's first rank (rank {block.leader}): {payload}")


def _check_output(out: AgentLoopOutput, prompt: list[int], length: int, name: str, row: int) -> None:
    where = f"agent loop {name!r} (row {row})"
    if list(out.prompt_ids) != prompt:
        raise ValueError(f"{where} returned other prompt ids than the row's; the training row must be what it was fed")
    sizes = {len(out.response_ids), len(out.response_mask), len(out.response_logprobs)}
    if len(sizes) != 1:
        raise ValueError(f"{where}: response_ids, response_mask and response_logprobs differ in length ({sizes})")
    if len(out.response_ids) > length:
        raise ValueError(
            f"{where} returned {len(out.response_ids)} response ids, more than rollout.response_length={length}"
        )
