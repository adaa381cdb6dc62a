"""Checks of a run's inputs before any work starts: `hf run` and `hf resume` call `check_run_inputs` before they
record a run or start a worker, so a mistake costs seconds and leaves nothing behind.

What is checked, each failure an `InputError` naming the config key and the fix:

- ``model.path`` / ``critic.model_path``: an embedded model (prepared), or a local folder holding a Hugging Face
  ``config.json`` and a tokenizer; a hub id (``org/name``) is refused: no model hub is reached from here.
- ``data.*``: every file exists and has verl's columns; the reasoning-gym generator exists; prompts fit
  ``data.max_prompt_length``; there are at least ``data.train_batch_size`` of them; every ``data_source`` has a
  reward (built in, or ``reward.custom_function``); with ``data.audit_labels`` (default), every label of a source
  that has an audit (`hybridflow.engine.audit`: exact arithmetic) is the value of its question.
- ``reward_model.path`` (when ``reward_model.enable``) and Safe-RLHF's ``reward_model.cost_path``: a one-label
  ``*ForSequenceClassification`` folder whose tokenizer pads (pad or EOS token), and ``reward_model.max_length``
  longer than the shortest training prompt rendered in its chat template (weights are not loaded here; the worker
  loads them before iteration 1).
- ``reward.custom_function`` (and ``reward.cost_function``): imports and names a function taking ``(data_source,
  solution_str, ground_truth, extra_info)``.
- ``placement.executor: slurm``: Slurm's commands answer; every pool's partition exists and has the nodes it asks.
- ``trainer.output_dir`` (and ``trainer.checkpoint_dir`` when set): can be created and written.
- ``trainer.resume_from``: a checkpoint folder whose files match its ``manifest.json``.
- ``trainer.logger``: the library of every tracker named (tensorboard, wandb, mlflow) is installed; an MLflow
  tracking server (``http(s)://`` URI) answers.

One warning, not a refusal, for every kind of run (`hf run`, `hf resume`, `hf rm train`, `hf sft train`, `hf verl`):
a dtype key set to bfloat16 where the local CPU emulates bf16 (`SlowDtypeWarning`, naming the key to set to
``native`` or float32).

Batch-size divisibility and the parallel layout are checked by the config itself (`HybridFlowConfig`).
The prompt sets built here are cached in the process, so the flow that follows does not build them again.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.engine.agent.chat_format import ChatFormat
from hybridflow.engine.agent.demonstrations import build_demonstrations
from hybridflow.engine.agent.rollout import check_agent_rows, prompt_tools, run_tools
from hybridflow.engine.audit import audit_rows
from hybridflow.engine.config import (
    DataConfig,
    HybridFlowConfig,
    Pool,
    PreferenceDataConfig,
    RMTrainingConfig,
    SFTDataConfig,
    SFTTrainingConfig,
    load_config,
)
from hybridflow.engine.config.dpo import DPOTrainingConfig
from hybridflow.engine.data import PromptDataset, build_prompt_rows, train_sampler
from hybridflow.engine.embedded_models import EMBEDDED_MODELS, resolve_model_path
from hybridflow.engine.epochs import split_held_out
from hybridflow.engine.extensions import engine_tp
from hybridflow.engine.models import cpu_has_native_bf16, load_tokenizer, pick_device
from hybridflow.engine.moe import moe_spec
from hybridflow.engine.reward.judge import check_judge, load_judge_functions
from hybridflow.engine.reward.preference import load_preference_rows
from hybridflow.engine.reward.reward_model import RewardModelError, check_reward_model, rendered_prompt_length
from hybridflow.engine.reward.rewards import check_builtin_source, load_reward_function
from hybridflow.engine.rollout.vllm_cpu_experts import CPU_EXPERT_ALIGNMENT, expert_intermediate_size
from hybridflow.engine.sft.conversations import load_conversations, tokenize_conversation
from hybridflow.engine.tracking import missing_libraries, mlflow_tracking_uri
from hybridflow.slurm import cluster, network

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class InputError(ValueError):
    """A run input cannot work; the message names the config key, the problem and the fix."""


class SlowDtypeWarning(UserWarning):
    """``model.dtype`` or ``rollout.vllm_dtype`` bfloat16 on a local CPU that emulates bf16
    (`hybridflow.engine.models.cpu_has_native_bf16`)."""


@dataclass
class PromptSets:
    """The tokenizer and the tokenized prompt sets of a config (validation may be None: no held-out prompts)."""

    tokenizer: Any
    train: PromptDataset
    val: PromptDataset | None


def check_run_inputs(cfg: HybridFlowConfig) -> None:
    """Check everything a run needs that the config alone cannot tell (see the module docstring).

    Raises:
        InputError: the first problem found, naming the key and the fix.
    """
    _check_trackers(cfg.trainer)
    _check_dtype(cfg)
    folder, tokenizer = model_tokenizer("model.path", cfg.model.path)
    _check_moe(cfg, folder)
    if cfg.critic.model_path:
        model_folder("critic.model_path", cfg.critic.model_path)
    if cfg.teacher.enabled:
        _check_teacher(cfg, tokenizer)
    rm = cfg.reward_model
    classifier = rm.path if rm.enable and not rm.judge.enable else None
    scorers = {"reward_model.path": classifier, "reward_model.cost_path": rm.cost_path}
    scorers = {key: _check_reward_model(path, key) for key, path in scorers.items() if path}
    if rm.enable and rm.judge.enable:
        _check_judge(cfg)
    functions = {"reward.custom_function": cfg.reward.custom_function, "reward.cost_function": cfg.reward.cost_function}
    for key, spec in functions.items():
        if spec:
            try:
                load_reward_function(spec, key)
            except (ValueError, ImportError, AttributeError, TypeError, FileNotFoundError) as e:
                raise InputError(str(e)) from None
    prompts = prompt_sets(cfg)
    try:
        train_sampler(prompts.train, cfg)
    except ValueError as e:
        raise InputError(str(e)) from None
    if cfg.teacher.routes:
        _check_routes(cfg.teacher, prompts.train)
    for rm_tokenizer in scorers.values():
        _check_reward_model_length(rm.max_length, prompts.train, rm_tokenizer)
    if cfg.data.audit_labels:
        _check_labels(prompts)
    if cfg.rollout.multi_turn.enable:
        rows = prompts.train.rows + (prompts.val.rows if prompts.val else [])
        try:
            check_agent_rows(cfg, rows, prompts.tokenizer, [prompts.tokenizer.eos_token_id])
        except ValueError as e:
            raise InputError(str(e)) from None
    if not cfg.reward.custom_function:
        rows = prompts.train.rows + (prompts.val.rows if prompts.val else [])
        for source in sorted({row["data_source"] for row in rows}):
            try:
                check_builtin_source(source)
            except ValueError as e:
                raise InputError(f"data: {e}") from None
    if cfg.placement.executor == "slurm":
        _check_slurm(cfg.pools(), "placement.pools." if cfg.placement.pools else "placement.")
    _check_writable("trainer.output_dir", Path(cfg.trainer.output_dir))
    if cfg.trainer.checkpoint_dir:
        _check_writable("trainer.checkpoint_dir", Path(cfg.trainer.checkpoint_dir))
    if cfg.trainer.resume_from not in (None, "auto"):
        _check_resume_from(cfg.trainer.resume_from, cfg.safe_rlhf())


def _check_moe(cfg: HybridFlowConfig, folder: Path) -> None:
    """A mixture-of-experts actor (`hybridflow.engine.moe.moe_spec` of ``model.path``'s config) must be one of the
    architectures that run, trained by ddp or fsdp.

    Raises:
        InputError: an MoE architecture that does not run; on megatron, router replay with pipeline parallelism
            (not built there yet) or an ``actor.ep`` not dividing the experts; ``actor.router_replay.mode`` other
            than disabled with a dense model, or R3 with an agent loop (its token engine records no routes) or
            another rollout than hf; ``trainer.log_routed_experts`` with a dense model or without router replay;
            ``rollout.expert_parallel_size`` with a dense model or not dividing the experts; a tensor-parallel
            vLLM-CPU engine whose expert shards its kernel would pad (`CPU_EXPERT_ALIGNMENT`).
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
        spec = moe_spec(config)
    except ValueError as e:
        raise InputError(f"model.path: {e}") from None
    replay = cfg.actor.router_replay.mode
    if cfg.trainer.log_routed_experts and (spec is None or replay == "disabled"):
        raise InputError(
            "trainer.log_routed_experts keeps the routed_experts that router replay carries in the batch, and "
            + (
                "model.path is a dense model: set trainer.log_routed_experts=false"
                if spec is None
                else "actor.router_replay.mode=disabled records none: set it to R2 or R3"
            )
        )
    if spec is None and cfg.rollout.expert_parallel_size > 1:
        raise InputError(
            f"rollout.expert_parallel_size={cfg.rollout.expert_parallel_size} splits a mixture-of-experts model's "
            "experts over the vLLM engine's ranks, and model.path is a dense model: remove rollout.expert_parallel_size"
        )
    if spec is None:
        if replay != "disabled":
            raise InputError(
                f"actor.router_replay.mode={replay} replays a mixture-of-experts model's expert choices, and "
                "model.path is a dense model: set actor.router_replay.mode=disabled"
            )
        return
    what = (
        f"model.path is a mixture-of-experts model ({spec.architecture}, {spec.num_experts} experts, top {spec.top_k})"
    )
    if cfg.actor.strategy == "megatron" and replay != "disabled" and cfg.actor.pp > 1:
        raise InputError(
            f"{what}, and actor.router_replay.mode={replay} on megatron-core is built without pipeline parallelism "
            f"here (actor.pp={cfg.actor.pp}): set actor.pp=1 (tensor and expert parallelism replay), use "
            "actor.strategy=fsdp, or set actor.router_replay.mode=disabled"
        )
    tp = engine_tp(cfg)
    on_cpu = pick_device(cfg.trainer.device).type == "cpu"
    shard = expert_intermediate_size(config) / tp
    if cfg.rollout.name == "vllm" and on_cpu and cfg.rollout.expert_parallel_size == 1 and shard % CPU_EXPERT_ALIGNMENT:
        raise InputError(
            f"{what}, and a vLLM-CPU engine over rollout.gen_tp={tp} ranks splits each expert's intermediate size "
            f"({expert_intermediate_size(config)}) into {shard:g} a rank, which vLLM 0.32's CPU kernel pads to a "
            f"multiple of {CPU_EXPERT_ALIGNMENT} and its weight reload then cannot fill: set "
            f"rollout.expert_parallel_size={tp} (whole experts a rank), or a rollout.gen_tp that keeps the split a "
            f"multiple of {CPU_EXPERT_ALIGNMENT}"
        )
    if spec.num_experts % cfg.rollout.expert_parallel_size:
        raise InputError(
            f"{what}, and rollout.expert_parallel_size={cfg.rollout.expert_parallel_size} does not divide its "
            f"{spec.num_experts} experts: pick a rollout.gen_tp and rollout.expert_parallel_size dividing "
            f"{spec.num_experts}"
        )
    if cfg.actor.strategy == "megatron" and spec.num_experts % cfg.actor.ep:
        raise InputError(
            f"{what}, and actor.ep={cfg.actor.ep} does not divide its {spec.num_experts} experts: every "
            f"expert-parallel rank holds the same number; pick actor.ep dividing {spec.num_experts}"
        )
    if cfg.actor.strategy != "megatron" and cfg.actor.ep > 1:
        raise InputError(f"{what}: actor.ep needs actor.strategy=megatron (fsdp shards experts as any weight)")
    if replay == "R3" and cfg.rollout.name != "hf":
        raise InputError(
            f"{what}, and actor.router_replay.mode=R3 replays the experts the rollout chose, which "
            f"rollout.name={cfg.rollout.name} records none here (vLLM 0.32 returns routes only from its V2 model "
            "runner, which needs Triton: vLLM-CPU refuses it; not wired for GPUs yet): use rollout.name=hf, or "
            "actor.router_replay.mode=R2"
        )
    if replay == "R3" and cfg.rollout.multi_turn.enable:
        raise InputError(
            "actor.router_replay.mode=R3 replays the experts the rollout chose, which only rollout.name=hf's batch "
            "generation records, not the agent loops' token engine: use actor.router_replay.mode=R2, or set "
            "rollout.multi_turn.enable=false"
        )


def _check_dtype(cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig) -> None:
    """Warn (`SlowDtypeWarning`) when the local ranks of any kind of run would compute in bf16 on this CPU without
    bf16 instructions, where torch and vLLM emulate it (on a 2-core AMD EPYC, 2026-11-27: a SmolLM2 forward and
    backward 151.8 s against 6.5 s in float32; vLLM decoding 17 against 87 tokens/s). Only an explicit
    ``bfloat16`` warns: ``auto`` and ``native`` pick float32 there. Slurm ranks run on other nodes' CPUs: not
    checked."""
    local_cpu = cfg.placement.executor != "slurm" and pick_device(cfg.trainer.device).type == "cpu"
    if not local_cpu or cpu_has_native_bf16():
        return
    slow = {"model.dtype": (cfg.model.dtype, "the model's forward and backward 23 times slower")}
    if isinstance(cfg, HybridFlowConfig):
        rm = cfg.reward_model
        judged = rm.enable and rm.judge.enable and rm.judge.engine == "vllm"
        slow["rollout.vllm_dtype"] = (
            cfg.rollout.vllm_dtype if cfg.rollout.name == "vllm" else None,
            "vLLM's decoding 5 times slower",
        )
        slow["reward_model.dtype"] = (
            rm.dtype if rm.enable and not rm.judge.enable else None,
            "the reward model's forward 23 times slower",
        )
        slow["reward_model.judge.vllm_dtype"] = (
            rm.judge.vllm_dtype if judged else None,
            "the judge's decoding 5 times slower",
        )
    for key, (value, cost) in slow.items():
        if value == "bfloat16":
            warnings.warn(
                f"{key}=bfloat16: this CPU has no bf16 instructions (AVX512-BF16 or AMX), so bf16 is emulated, "
                f"{cost} than float32: set {key}=native (bf16 only where the hardware computes it; -o {key}=native) "
                "or float32",
                SlowDtypeWarning,
                stacklevel=3,
            )


def _check_labels(prompts: PromptSets) -> None:
    """Refuse prompts whose labels fail their audit (`hybridflow.engine.audit`), naming the first failures and the
    fix."""
    for name, dataset in (("training", prompts.train), ("validation", prompts.val)):
        if dataset is None:
            continue
        result = audit_rows(dataset.rows)
        if result.failures:
            shown = "; ".join(f"{question} {problem}" for _, _, question, problem in result.failures[:3])
            raise InputError(
                f"data: {len(result.failures)} of {result.audited} {name} labels are not the value of their question "
                f"(e.g. {shown}). Fix the data (`hf data check CONFIG` lists every failure; with reasoning-gym's "
                'basic_arithmetic and allow_parentheses: false, drop "/" from data.reasoning_gym.config.operators: '
                "reasoning-gym 0.1.25 mislabels its divisions), or set data.audit_labels=false to train on them anyway"
            )


def _check_reward_model(path: str, key: str = "reward_model.path") -> Any:
    """The RM's tokenizer, after `check_reward_model` accepted its folder (`key`: ``reward_model.path``, or Safe-RLHF's
    cost model, ``reward_model.cost_path``)."""
    folder = model_folder(key, path)
    try:
        return check_reward_model(folder, key)[1]
    except RewardModelError as e:
        raise InputError(str(e)) from None


def _check_judge(cfg: HybridFlowConfig) -> None:
    """A generative reward model (``reward_model.judge``): a causal LM at ``reward_model.path``, the two user
    functions loadable with their arguments, and vLLM installed for ``judge.engine: vllm``."""
    judge = cfg.reward_model.judge
    folder = model_folder("reward_model.path", cfg.reward_model.path)
    try:
        check_judge(folder)
        load_judge_functions(cfg.reward_model)
    except (RewardModelError, ValueError, ImportError, AttributeError, TypeError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    if judge.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from hybridflow.engine.rollout.vllm import install_hint

        raise InputError(install_hint("reward_model.judge.engine=vllm", "reward_model.judge.engine=hf"))


def _check_reward_model_length(max_length: int, train: PromptDataset, rm_tokenizer: Any) -> None:
    """Refuse a ``reward_model.max_length`` that cannot hold even the shortest training prompt (in the RM's chat
    template, before any response): the RM would never see a whole prompt."""
    shortest = min(rendered_prompt_length(row["prompt"], rm_tokenizer) for row in train.rows)
    if max_length <= shortest:
        raise InputError(
            f"reward_model.max_length={max_length} tokens is not longer than the shortest training prompt "
            f"({shortest} tokens in the reward model's chat template): the RM would score no prompt whole; raise "
            f"reward_model.max_length above {shortest} plus the response (rollout.response_length)"
        )


def _check_trackers(trainer: Any) -> None:
    """Every tracker of ``trainer.logger`` has its library; an MLflow tracking server answers."""
    if missing := missing_libraries(trainer.logger):
        raise InputError(
            f"trainer.logger names {', '.join(missing)}, whose library is not installed: pip install "
            f"'hybridflow[trackers]' (or remove {', '.join(missing)} from trainer.logger)"
        )
    if "mlflow" in trainer.logger:
        _check_mlflow_server(mlflow_tracking_uri(trainer.mlflow_tracking_uri, trainer.output_dir))


def _check_teacher(cfg: HybridFlowConfig, student: Any) -> None:
    """A teacher scores the actor's tokens by their ids: each teacher's tokenizer (``teacher.model_path``, or every
    one of ``teacher.routes``) must be the actor's, `student` (the same vocabulary, token for id, and the same
    end-of-sequence token).

    Raises:
        InputError: a teacher's folder cannot be used, or its tokenizer is another one (the first token that
            differs named), or ``teacher.top_k`` exceeds its vocabulary."""
    for route, path in cfg.teacher.model_paths().items():
        key = f"teacher.routes.{route}" if cfg.teacher.routes else "teacher.model_path"
        _, teacher = model_tokenizer(key, path)
        ours, theirs = student.get_vocab(), teacher.get_vocab()
        if ours != theirs or student.eos_token_id != teacher.eos_token_id:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
            first = f"token id {differing[0][1]}: {differing[0][0]!r}" if differing else "the end-of-sequence token"
            raise InputError(
                f"{key}: the teacher's tokenizer is not the actor's ({len(theirs)} tokens vs {len(ours)} of "
                f"model.path; they differ at {first}), and the teacher scores the actor's tokens by their ids: "
                "distil from a teacher of the actor's tokenizer (its family's models)"
            )
        if cfg.teacher.top_k > len(theirs):
            raise InputError(
                f"teacher.top_k={cfg.teacher.top_k}: the teacher's vocabulary has {len(theirs)} tokens ({key}), fewer "
                f"than its top_k: set teacher.top_k to at most {len(theirs)} (tens are the usual choice)"
            )


def _check_routes(teacher: Any, train: PromptDataset) -> None:
    """With several teachers (``teacher.routes``) every training row's ``teacher.route_key`` value needs one (the
    teachers score the training batches only, as verl's).

    Raises:
        InputError: naming the values without a teacher, how many rows hold them, and the key to add."""
    values = Counter(str(row.get(teacher.route_key, "")) for row in train.rows)
    missing = {value: n for value, n in values.items() if value not in teacher.routes}
    if missing:
        listed = ", ".join(f"{value!r} ({n} rows)" for value, n in sorted(missing.items()))
        raise InputError(
            f"teacher.routes: the training prompts' {teacher.route_key} values {listed} have no teacher (teachers: "
            f"{', '.join(map(repr, sorted(teacher.routes)))}): add teacher.routes.<value>=DIR for each, or drop those "
            "rows from data.train_files"
        )


def model_folder(key: str, value: str) -> Path:
    """The local folder of a model setting (an embedded model's prepared folder, or the path itself).

    Raises:
        InputError: for a hub id, a missing or unprepared model, or a folder without a usable tokenizer.
    """
    return model_tokenizer(key, value)[0]


def model_tokenizer(key: str, value: str) -> tuple[Path, Any]:
    """`model_folder` and the tokenizer it loaded from there to check the folder (`load_tokenizer`).

    Raises:
        InputError: as `model_folder`.
    """
    folder = Path(value).expanduser()
    if folder.is_symlink() and not folder.exists():  # a relative link resolves from the link's own folder
        raise InputError(
            f"{key}: {value} is a symbolic link to {folder.readlink()}, which does not exist (a relative target is "
            f"read from {folder.parent}/): link it to an absolute path, or set {key} to the folder itself"
        )
    if value not in EMBEDDED_MODELS and not folder.exists() and _HUB_ID.match(value):
        raise InputError(
            f"{key}: {value!r} looks like a model hub id, and there is no model hub here: download it elsewhere "
            f"(e.g. `hf download {value} --local-dir DIR` on a machine with internet), copy the folder here and "
            f"set {key}=DIR; or use an embedded model: {', '.join(sorted(EMBEDDED_MODELS))}"
        )
    try:
        folder = resolve_model_path(value)
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as e:
        raise InputError(str(e).replace("model.path", key)) from None
    except (OSError, ValueError) as e:
        raise InputError(f"{key}: the folder {folder} has no tokenizer transformers can load ({e})") from None
    return folder, tokenizer


def prompt_sets(cfg: HybridFlowConfig) -> PromptSets:
    """The config's tokenizer and tokenized train / validation prompts, built once per process and config.

    Raises:
        InputError: a prompt file is missing or malformed, the reasoning-gym generator or its settings are
            unknown, or every prompt is longer than ``data.max_prompt_length``.
    """
    try:
        tools = prompt_tools(cfg)
    except (ValueError, ImportError, AttributeError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    return _prompt_sets(str(resolve_model_path(cfg.model.path)), cfg.data.model_dump_json(), json.dumps(tools))


@functools.lru_cache(maxsize=2)
def _prompt_sets(model_folder: str, data_json: str, tools_json: str = "null") -> PromptSets:
    data = DataConfig.model_validate(json.loads(data_json))
    tools = json.loads(tools_json)
    tokenizer = load_tokenizer(model_folder)
    try:
        train_rows, val_rows = build_prompt_rows(data)
        train = PromptDataset(train_rows, tokenizer, data.max_prompt_length, tools=tools)
        val = PromptDataset(val_rows, tokenizer, data.max_prompt_length, tools=tools) if val_rows else None
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    return PromptSets(tokenizer, train, val)


@dataclass
class PreferenceSets:
    """The tokenizer and the preference pairs of a reward-model training config (held-out pairs may be empty)."""

    tokenizer: Any
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]


def preference_sets(cfg: RMTrainingConfig) -> PreferenceSets:
    """The pairs of ``data.train_files`` (less the held-out ``data.val_fraction`` when no ``data.val_files``) and
    of ``data.val_files``, read once per process and config.

    Raises:
        InputError: a file is missing or malformed, or there are fewer training pairs than ``data.train_batch_size``.
    """
    return _preference_sets(str(resolve_model_path(cfg.model.path)), cfg.data.model_dump_json())


@functools.lru_cache(maxsize=2)
def _preference_sets(model_folder: str, data_json: str) -> PreferenceSets:
    data = PreferenceDataConfig.model_validate(json.loads(data_json))
    try:
        train = [row for path in data.train_files for row in load_preference_rows(path)]
        val = [row for path in data.val_files for row in load_preference_rows(path)]
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    if not data.val_files:
        train, val = split_held_out(train, data.val_fraction, data.seed)
    if len(train) < data.train_batch_size:
        raise InputError(
            f"data.train_files hold {len(train)} training pairs, fewer than one data.train_batch_size "
            f"({data.train_batch_size}): add pairs or lower data.train_batch_size"
        )
    return PreferenceSets(load_tokenizer(model_folder), train, val)


def check_rm_inputs(cfg: RMTrainingConfig) -> None:
    """What ``hf rm train`` needs that the config alone cannot tell: ``model.path`` (a local folder with a
    tokenizer), the preference files (`preference_sets`), the trackers, the Slurm partition, ``trainer.output_dir``.

    Raises:
        InputError: the first problem found, naming the key and the fix.
    """
    _check_one_group_run(cfg, preference_sets, "reward_model")


def check_dpo_inputs(cfg: DPOTrainingConfig) -> None:
    """What ``hf dpo train`` needs that the config alone cannot tell: those of ``hf rm train`` for its pairs
    (`check_rm_inputs`, the group hosting the policy), the reference's folder (``dpo.ref_model_path``), and that the
    policy's chat template renders each conversation starting with its prompt (the first pairs'
    `hybridflow.engine.dpo.pairs.pair_token_ids`).

    Raises:
        InputError: the first problem found, naming the key and the fix.
    """
    from hybridflow.engine.dpo.pairs import pair_token_ids

    _check_one_group_run(cfg, preference_sets, "actor")
    if cfg.dpo.ref_model_path:
        model_folder("dpo.ref_model_path", cfg.dpo.ref_model_path)
    sets = preference_sets(cfg)
    for row in (sets.train + sets.val)[:8]:
        try:
            pair_token_ids(row, sets.tokenizer, cfg.data.max_length)
        except ValueError as e:
            raise InputError(f"data.train_files: {e}") from None


def _check_one_group_run(cfg: RMTrainingConfig | SFTTrainingConfig, load_sets: Any, role: str) -> None:
    """The checks of a one-group run: trackers, ``model.path``, its rows (`load_sets`), the Slurm partition of its
    group (hosting `role`), ``trainer.output_dir``."""
    _check_trackers(cfg.trainer)
    _check_dtype(cfg)
    model_folder("model.path", cfg.model.path)
    load_sets(cfg)
    if cfg.placement.executor == "slurm":
        _check_slurm({role: cfg.placement.pool(role, [role])}, "placement.")
    _check_writable("trainer.output_dir", Path(cfg.trainer.output_dir))


@dataclass
class ConversationSets:
    """The tokenizer and the tokenized conversations of an SFT config (`tokenize_conversation`: ``(ids, loss_mask)``
    per conversation), with how many were made, dropped for length, or left out of the demonstrations."""

    tokenizer: Any
    train: list[tuple[list[int], list[int]]]
    val: list[tuple[list[int], list[int]]]
    counts: dict[str, int]


def conversation_sets(cfg: SFTTrainingConfig) -> ConversationSets:
    """The conversations of ``data.train_files`` and of ``data.demonstrations`` (made from its RL config's training
    prompts and tools), less the held-out ``data.val_fraction`` when no ``data.val_files``, tokenized; read once per
    process and config.

    Raises:
        InputError: a file or the RL config is missing or malformed, every conversation is longer than
            ``data.max_length``, or there are fewer training conversations than ``data.train_batch_size``.
    """
    return _conversation_sets(str(resolve_model_path(cfg.model.path)), cfg.data.model_dump_json())


@functools.lru_cache(maxsize=2)
def _conversation_sets(model_folder: str, data_json: str) -> ConversationSets:
    data = SFTDataConfig.model_validate(json.loads(data_json))
    tokenizer = load_tokenizer(model_folder)
    counts: dict[str, int] = {}
    try:
        train = [c for path in data.train_files for c in load_conversations(path)]
        val = [c for path in data.val_files for c in load_conversations(path)]
        if data.demonstrations is not None:
            rl = load_config(Path(data.demonstrations.rl_config))
            rl_train, _ = build_prompt_rows(rl.data)  # the RL run's validation prompts stay unseen
            rl_train = rl_train[: data.demonstrations.size]
            made, counts = build_demonstrations(rl_train, data.demonstrations.builder, run_tools(rl))
            train += made
        chat_format = ChatFormat(tokenizer, [tokenizer.eos_token_id])
        if not data.val_files:
            train, val = split_held_out(train, data.val_fraction, data.seed)
        tokenized = {
            name: [tokenize_conversation(c, tokenizer, chat_format, tokenizer.eos_token_id) for c in rows]
            for name, rows in (("train", train), ("val", val))
        }
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as e:
        raise InputError(f"data: {e}") from None
    kept = {name: [r for r in rows if len(r[0]) <= data.max_length] for name, rows in tokenized.items()}
    counts["too_long"] = sum(len(tokenized[n]) - len(kept[n]) for n in kept)
    if len(kept["train"]) < data.train_batch_size:
        raise InputError(
            f"{len(kept['train'])} training conversations of at most data.max_length={data.max_length} tokens "
            f"({counts['too_long']} longer ones dropped), fewer than one data.train_batch_size "
            f"({data.train_batch_size}): add conversations, raise data.max_length or lower data.train_batch_size"
        )
    return ConversationSets(tokenizer, kept["train"], kept["val"], counts)


def check_sft_inputs(cfg: SFTTrainingConfig) -> None:
    """What ``hf sft train`` needs that the config alone cannot tell: ``model.path``, the conversations
    (`conversation_sets`), the trackers, the Slurm partition, ``trainer.output_dir``.

    Raises:
        InputError: the first problem found, naming the key and the fix.
    """
    _check_one_group_run(cfg, conversation_sets, "actor")


def _check_slurm(pools: dict[str, Pool], prefix: str) -> None:
    """Slurm answers, each pool's partition (``placement.slurm.partition``, or the pool's own) exists and has at
    least the pool's nodes, and its network interface (``slurm.interface``), if named, has an address on this host
    (the controller's channel listens there; a node without it: its rank's error names the node). `prefix`: where
    a pool's keys live (``placement.pools.`` + its name, or ``placement.`` for the layouts of
    ``placement.colocate``)."""
    try:
        found = cluster.partitions()
    except cluster.SlurmCommandError as e:
        raise InputError(
            f"placement.executor=slurm, but Slurm does not answer here: {e}. Run hf on a Slurm login node, or set "
            "placement.executor=local"
        ) from None
    nodes = {name.rstrip("*"): count for name, count in found.items()}
    default = next((name.rstrip("*") for name in found if name.endswith("*")), None)
    for name, pool in pools.items():
        keys = f"{prefix}{name}." if prefix == "placement.pools." else prefix
        partition = pool.slurm.partition
        if partition is not None and partition not in nodes:
            raise InputError(
                f"{keys}slurm.partition: no partition {partition!r} on this cluster (partitions: "
                f"{', '.join(nodes) or 'none'}); set one of them, or leave it unset for the cluster's default"
            )
        if pool.slurm.interface is not None:  # the controller listens there for the pool's ranks
            try:
                network.interface_address(pool.slurm.interface)
            except ValueError as e:
                raise InputError(f"{keys}slurm.interface: {e}") from None
        partition = partition or default
        if partition is not None and pool.nodes > nodes[partition]:
            raise InputError(
                f"{keys}nodes: pool {name} asks for {pool.nodes} nodes, and partition {partition!r} has "
                f"{nodes[partition]}; lower {keys}nodes (raise tasks_per_node instead), or pick a larger partition "
                f"with {keys}slurm.partition"
            )


def _check_mlflow_server(uri: str) -> None:
    """An ``http(s)://`` MLflow tracking server must answer its health check (5 s); local stores need nothing."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5):
            pass
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise InputError(
            f"trainer.logger has mlflow, but the MLflow tracking server {uri} does not answer ({reason}); start it, "
            "fix trainer.mlflow_tracking_uri (or $MLFLOW_TRACKING_URI), or remove mlflow from trainer.logger"
        ) from None


def _check_resume_from(value: str, cost_critic: bool = False) -> None:
    """The checkpoint verifies; a Safe-RLHF run's (`cost_critic`) holds a cost critic to continue."""
    from hybridflow.engine.checkpoint import CheckpointError, verify_checkpoint

    try:
        verify_checkpoint(value)
    except (CheckpointError, OSError) as e:
        raise InputError(
            f"trainer.resume_from={value}: not a usable checkpoint ({e}); give a global_step_<N> folder written by "
            "HybridFlow (its manifest.json lists every file), or remove the key to start from model.path"
        ) from None
    if cost_critic and not (Path(value) / "cost_critic").is_dir():
        raise InputError(
            f"trainer.resume_from={value}: the checkpoint has no cost_critic/ (a run without Safe-RLHF wrote it), and "
            "algorithm.cost_limit needs one to continue: resume a Safe-RLHF run's checkpoint, or remove "
            "trainer.resume_from (or algorithm.cost_limit)"
        )


def _check_writable(key: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise InputError(f"{key}: cannot write to {folder.resolve()} ({e.strerror}); set a writable folder") from None
