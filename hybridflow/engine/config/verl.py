"""verl's config keys, both ways.

A verl user's run is a shell script of Hydra overrides (``python3 -m verl.trainer.main_ppo
algorithm.adv_estimator=grpo actor_rollout_ref.actor.optim.lr=1e-6 ...``) and, at times, a ``ppo_trainer.yaml``-style
file. `translate` turns them into HybridFlow overrides, so the script runs with ``hf verl`` in place of the entry
point; `to_verl` writes a HybridFlow config in verl's keys (``hf config show --as-verl``). What each verl key is here
is `hybridflow.engine.config.verl_keys.VERL_KEYS` (mapped, no effect, or refused naming the nearest).

Unset keys take verl's defaults (`VERL_DEFAULTS`, from verl's ``ppo_trainer.yaml``) where verl's default changes
what is computed and differs from ours (verl's ``adv_estimator`` is ``gae``, ours ``grpo``); where it only concerns
placement, trackers or paths (``trainer.n_gpus_per_node: 8``, ``trainer.logger: [console, wandb]``), ours stands.
Keys verl fills by interpolation from another key (``critic.ppo_mini_batch_size`` from the actor's) follow that key
here too (`_INHERITED`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hybridflow.engine.config.hydra_overrides import parse_hydra_overrides, resolve_interpolations
from hybridflow.engine.config.loading import ConfigError, _yaml_problem, dotted_leaves
from hybridflow.engine.config.verl_keys import ARR, MODEL_ENGINES, UNSAID, VERL_KEYS, find_key

VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    f"{ARR}.actor.strategy": "fsdp",
    f"{ARR}.actor.ppo_mini_batch_size": 256,
    f"{ARR}.actor.shuffle": False,
    f"{ARR}.actor.policy_loss.ppo_kl_coef": 0.1,
    f"{ARR}.rollout.n": 1,
    "critic.strategy": "fsdp",
    "trainer.total_epochs": 30,
}
"""verl's defaults (``verl/trainer/config/ppo_trainer.yaml``) that change what is computed and differ from ours."""

VERL_CONFIG_NAMES: dict[str, dict[str, Any]] = {
    "ppo_trainer": {},
    "ppo_megatron_trainer": {
        f"{ARR}.actor.strategy": "megatron",
        f"{ARR}.ref.strategy": "megatron",
        "critic.strategy": "megatron",
    },
}
"""verl's own config files (``verl/trainer/config``), as its scripts name them (``--config-path=config
--config-name='ppo_megatron_trainer.yaml'``): what each sets that changes what is computed, beyond `VERL_DEFAULTS`.
``ppo_megatron_trainer.yaml`` sets the megatron strategy of the actor, ref, critic and reward model; the reward model
scores with fsdp here (the same scores)."""

_INHERITED = {
    "critic.ppo_mini_batch_size": f"{ARR}.actor.ppo_mini_batch_size",
    "critic.ppo_epochs": f"{ARR}.actor.ppo_epochs",
    "critic.shuffle": f"{ARR}.actor.shuffle",
    "critic.loss_agg_mode": f"{ARR}.actor.loss_agg_mode",
    "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
}
"""verl's interpolations (``critic.ppo_epochs: ${oc.select:actor_rollout_ref.actor.ppo_epochs,1}``): the key on
the left takes the value of the one on the right unless it is set itself."""


def read_verl_file(path: str | Path) -> dict[str, Any]:
    """The dotted keys and values of a verl config file (``ppo_trainer.yaml`` layout; Hydra's ``defaults`` list
    and ``hydra`` section dropped: verl's defaults are `VERL_DEFAULTS` here). ``${a.b}`` values are kept as written:
    `translate` resolves them with the command line's keys.

    Raises:
        ConfigError: the file is not YAML of sections."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of verl's sections (data, actor_rollout_ref, ...)")
    tree.pop("defaults", None)
    tree.pop("hydra", None)
    return {k: v for k, v in dotted_leaves(tree).items() if not k.endswith("_target_")}  # Hydra's classes


@dataclass(frozen=True)
class Translation:
    """What `translate` made of a verl command line.

    Attributes:
        overrides: HybridFlow ``key=value`` overrides (YAML values), in order: verl's defaults, then the user's keys.
        no_effect: ``(verl key, why)`` for each key given that has no effect here (said when the run starts).
    """

    overrides: list[str]
    no_effect: list[tuple[str, str]]


def translate(
    overrides: list[str], config_file: str | Path | None = None, config_name: str | None = None
) -> Translation:
    """Translate verl's Hydra overrides (``["algorithm.adv_estimator=grpo", ...]``, values parsed as YAML) over an
    optional verl config file (or one of verl's own, by `config_name`: `VERL_CONFIG_NAMES`) into HybridFlow
    overrides, with verl's defaults (`VERL_DEFAULTS`) for the keys not given and verl's interpolations
    (`_INHERITED`).

    ``trainer.total_epochs`` (unless ``trainer.total_training_steps`` is given) becomes ``trainer.total_iterations``
    = epochs x (rows of ``data.train_files`` // ``data.train_batch_size``), so the files are read for their row
    count. ``custom_reward_function.path`` and ``.name`` become ``reward.custom_function=path:name``.

    Raises:
        ConfigError: listing every unsupported key (with the nearest supported one) or unsupported value, or a
            malformed override; nothing is run."""
    command_line = parse_hydra_overrides(overrides)
    given = dict(VERL_CONFIG_NAMES[config_name]) if config_name else {}
    given.update(read_verl_file(config_file) if config_file else {})
    given.update(_engine_choices(command_line.values))  # Hydra's defaults list, beneath the values given
    for deleted in command_line.deleted:  # ~key: back to verl's default
        given = {k: v for k, v in given.items() if k != deleted and not k.startswith(f"{deleted}.")}
    given.update(_flattened(command_line.values))
    values = resolve_interpolations({**VERL_DEFAULTS, **given})
    given = {key: values[key] for key in given}
    for key, source in _INHERITED.items():
        if key not in values and source in values:
            values[key] = values[source]
    errors: list[str] = []
    ours: dict[str, Any] = {}
    no_effect: list[tuple[str, str]] = []
    for key, value in values.items():
        try:
            entry = find_key(key)
            ours.update(entry.convert(value, key))
        except (ConfigError, TypeError, ValueError) as e:
            errors.append(str(e) if isinstance(e, ConfigError) else f"verl key {key}={value!r}: {e}")
            continue
        if not entry.ours and not entry.via and key in given:
            no_effect.append((key, entry.note))
    errors += _cross_checks(values)
    distilled, distill_errors = _distillation(values)
    ours.update(distilled)
    errors += distill_errors
    if values.get("trainer.resume_mode") == "resume_path":  # verl reads resume_from_path in this mode only
        path = values.get("trainer.resume_from_path")
        if path in (None, "", "null"):
            errors.append(
                "verl key trainer.resume_mode=resume_path needs trainer.resume_from_path: a checkpoint folder "
                "global_step_N"
            )
        ours["trainer.resume_from"] = str(path)
    if errors:
        raise ConfigError("hf verl cannot run this command line:\n  " + "\n  ".join(errors))
    for section in ("custom_reward_function", "reward.custom_reward_function"):  # verl's older and current spelling
        if values.get(f"{section}.path"):
            name = values.get(f"{section}.name") or "compute_score"
            ours["reward.custom_function"] = f"{values[f'{section}.path']}:{name}"
    if "trainer.total_training_steps" not in given or given["trainer.total_training_steps"] is None:
        ours["trainer.total_iterations"] = _epochs_to_iterations(values)
    ours.update(_lr_schedules(values, int(ours["trainer.total_iterations"])))
    for section, model, ours_key in ((f"{ARR}.actor", ARR, "model"), ("critic", "critic", "critic")):
        granularity = values.get(f"{section}.megatron.override_transformer_config.recompute_granularity")
        if f"{model}.model.enable_gradient_checkpointing" not in given and granularity not in (None, "null"):
            ours[f"{ours_key}.gradient_checkpointing"] = True
    for key in ("data.val_batch_size", "reward_model.max_length"):
        if ours.get(key) is None:
            ours.pop(key, None)
    return Translation([f"{key}={override_value(value)}" for key, value in ours.items()], no_effect)


def _cross_checks(values: dict[str, Any]) -> list[str]:
    """Refusals of a verl key whose value is taken only together with another's."""
    errors = []
    do_sample = values.get(f"{ARR}.rollout.val_kwargs.do_sample")
    temperature = values.get(f"{ARR}.rollout.val_kwargs.temperature") or 0
    if do_sample is False and float(temperature) > 0:
        errors.append(
            f"verl key {ARR}.rollout.val_kwargs.do_sample=False with val_kwargs.temperature={temperature} is not "
            "supported here: validation is greedy exactly when the temperature is 0; set val_kwargs.temperature=0"
        )
    for section in ("reward_model", "reward"):  # verl's older and current spelling
        max_resp_len = values.get(f"{section}.reward_kwargs.max_resp_len")
        if max_resp_len is not None and int(max_resp_len) != int(values["data.max_response_length"]):
            errors.append(
                f"verl key {section}.reward_kwargs.max_resp_len={max_resp_len} is not supported here: the overlong "
                f"buffer ends at data.max_response_length ({values['data.max_response_length']}); give the same value"
            )
    return errors


_DISTILL_LOSS = "distillation.distillation_loss"
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _distillation(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our ``teacher.*`` (and the actor's terms verl drops) for verl main's ``distillation.*`` section, and the
    refusals of what is not implemented. verl's YAML defaults (``distillation/distillation.yaml``): ``loss_mode: k3``,
    ``use_policy_gradient: false``, ``use_task_rewards: true``, ``distillation_loss_coef: 1.0``.

    verl's distillation term (``verl/trainer/distillation/losses.py``): D per token is k1 = log p - log q, k2 =
    (log p - log q)^2 / 2, k3 (low_var_kl), abs, or forward_kl_topk (``teacher.top_k_kl: forward`` over ``topk``
    tokens, ``log_prob_min_clamp`` the floor), clamped to [-loss_max_clamp, loss_max_clamp]; with
    use_policy_gradient a PPO-clip loss of advantage -D (current log-probs, detached), else agg(D); added to the PPO
    loss x distillation_loss_coef, or alone with use_task_rewards false. Here: teacher.use_as reward (advantage
    task_coef x A - kl_coef x D with the old log-probs: the same where one mini-batch of one epoch makes them the
    current ones) or loss (kl_coef x agg(D)).

    One teacher scores every row (verl's single-teacher path ignores its key); several are ``teacher.routes`` by
    their ``key`` (verl's ``teacher_manager.py::_resolve_teacher_key``: a row's ``teacher_key`` value picks its
    teacher), verl's placeholder ``teacher_model`` dropped once others are named, as verl drops it."""
    if not values.get("distillation.enabled"):
        return {}, []
    teachers = {
        key.split(".")[2]: value
        for key, value in values.items()
        if re.fullmatch(r"distillation\.teacher_models\.[^.]+\.model_path", key) and value
    }
    if len(teachers) > 1:  # verl drops its placeholder teacher_model once others are named
        teachers.pop("teacher_model", None)
    if not teachers:
        return {}, [
            "verl key distillation.enabled=True needs a teacher: give distillation.teacher_models.teacher_model."
            "model_path"
        ]
    errors = []
    ours: dict[str, Any] = {}
    if len(teachers) == 1:  # verl's single teacher scores every row, whatever its key
        ours["teacher.model_path"] = next(iter(teachers.values()))
    else:
        routes = {values.get(f"distillation.teacher_models.{name}.key"): path for name, path in teachers.items()}
        unkeyed = sorted(name for name in teachers if values.get(f"distillation.teacher_models.{name}.key") is None)
        if unkeyed or len(routes) < len(teachers):
            errors.append(
                f"verl key distillation.teacher_models: each of several teachers needs its own key, the "
                f"distillation.teacher_key value of the rows it scores ({', '.join(unkeyed) or 'duplicate keys'}): "
                "give distillation.teacher_models.<name>.key=<data_source>"
            )
        ours["teacher.routes"] = {str(k): v for k, v in routes.items() if k is not None}
    mode = str(values.get(f"{_DISTILL_LOSS}.loss_mode", "k3"))
    mode = _KL_ALIASES.get(mode, mode)
    policy_gradient = bool(values.get(f"{_DISTILL_LOSS}.use_policy_gradient", False))
    with_task = bool(values.get(f"{_DISTILL_LOSS}.use_task_rewards", True))
    coef = float(values.get(f"{_DISTILL_LOSS}.distillation_loss_coef", 1.0))
    if policy_gradient and mode != "k1":
        errors.append(
            f"verl key {_DISTILL_LOSS}.loss_mode={mode} with use_policy_gradient=True is not supported here: the "
            "policy-gradient term takes k1, the sampled token's log-ratio (teacher.use_as=reward); for k2, k3 or abs "
            "set use_policy_gradient=False (a loss)"
        )
    elif not policy_gradient and mode not in ("k2", "k3", "abs", "forward_kl_topk"):
        errors.append(
            f"verl key {_DISTILL_LOSS}.loss_mode={mode} with use_policy_gradient=False is not supported here: a "
            "distillation loss takes k2 (mse), k3 (low_var_kl), abs or forward_kl_topk; k1 needs "
            "use_policy_gradient=True"
        )
    ours["teacher.use_as"] = "reward" if policy_gradient else "loss"
    if mode == "forward_kl_topk" and not policy_gradient:  # verl/trainer/distillation/fsdp/losses.py
        ours["teacher.top_k"] = int(values.get(f"{_DISTILL_LOSS}.topk", 32))
        ours["teacher.top_k_kl"] = "forward"
        floor = values.get(f"{_DISTILL_LOSS}.log_prob_min_clamp")
        if floor not in (None, "null"):
            ours["teacher.log_prob_floor"] = float(floor)
    elif not policy_gradient:
        ours["teacher.kl_loss_type"] = mode
    if policy_gradient and not _one_on_policy_update(values):
        errors.append(
            f"verl key {_DISTILL_LOSS}.use_policy_gradient=True is taken with one mini-batch of one epoch here "
            "(actor_rollout_ref.actor.ppo_mini_batch_size = data.train_batch_size, ppo_epochs=1): the distillation "
            "reward uses the old log-probs, verl's the current mini-batch's"
        )
    if with_task and coef <= 0:
        errors.append(
            f"verl key {_DISTILL_LOSS}.distillation_loss_coef={coef} trains without the teacher: "
            "set distillation.enabled=False"
        )
    ours["teacher.task_coef"], ours["teacher.kl_coef"] = (1.0, coef) if with_task else (0.0, 1.0)
    if not with_task:  # verl replaces the whole PPO loss, its entropy bonus and KL loss with it
        ours.update({"actor.entropy_coeff": 0.0, "actor.use_kl_loss": False})
    temperature = float(values.get(f"{ARR}.rollout.temperature", 1.0))
    if temperature != 1.0:
        errors.append(
            f"verl key {ARR}.rollout.temperature={temperature} with distillation is not supported here: verl's "
            "teacher scores at temperature 1 and ours at the rollout's; set rollout.temperature=1"
        )
    return ours, errors


def _one_on_policy_update(values: dict[str, Any]) -> bool:
    """Whether the actor updates once per batch (one mini-batch, one epoch): its old log-probs are then the current."""
    batch = int(values.get("data.train_batch_size", 0))
    mini = int(values.get(f"{ARR}.actor.ppo_mini_batch_size", batch))
    return mini >= batch and int(values.get(f"{ARR}.actor.ppo_epochs", 1) or 1) == 1


def _flattened(values: dict[str, Any]) -> dict[str, Any]:
    """A Hydra dict value of a section (``actor_rollout_ref.actor.optim={lr:1e-6,betas:[0.9,0.99]}``) as its
    dotted keys, as Hydra merges it into verl's config; a key the table takes whole keeps its value."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and not _taken_whole(key):
            out.update(dotted_leaves(value, f"{key}."))
        else:
            out[key] = value
    return out


def _taken_whole(key: str) -> bool:
    try:
        find_key(key)
    except ConfigError:
        return False
    return True


_ENGINE_GROUPS = {
    f"actor@{ARR}.actor": (f"{ARR}.actor.strategy", "_actor"),
    f"ref@{ARR}.ref": (f"{ARR}.ref.strategy", "_ref"),
    "critic@critic": ("critic.strategy", "_critic"),
}
"""verl's defaults-list groups that pick a training engine per role (``actor@actor_rollout_ref.actor=megatron_actor``):
the strategy key each sets and the suffix of its options."""


def _engine_choices(given: dict[str, Any]) -> dict[str, Any]:
    """What verl main's defaults-list choices on the command line set beneath the values given: ``model_engine=E``
    (`MODEL_ENGINES`) the actor's, ref's and critic's strategy; ``actor@actor_rollout_ref.actor=E_actor`` (and ref,
    critic) one role's. Options `find_key` does not take are refused there."""
    chosen: dict[str, Any] = {}
    engine = given.get("model_engine", given.get(f"{ARR}.actor.model_engine"))
    if engine in MODEL_ENGINES:
        strategy = MODEL_ENGINES[engine]
        chosen.update({key: strategy for key, _ in _ENGINE_GROUPS.values()})
    for group, (key, suffix) in _ENGINE_GROUPS.items():
        option = str(given.get(group, ""))
        if option.removesuffix(suffix) in MODEL_ENGINES and option.endswith(suffix):
            chosen[key] = MODEL_ENGINES[option.removesuffix(suffix)]
    return chosen


def _role_engine(values: dict[str, Any], role: str) -> str | None:
    """The verl engine training `role` (``actor`` or ``critic``): its defaults-list group's option
    (``critic@critic=veomni_critic``), else ``model_engine``; None: verl's legacy workers (``*.strategy``)."""
    group = {"actor": f"actor@{ARR}.actor", "critic": "critic@critic"}[role]
    option = str(values.get(group, ""))
    if option.endswith(f"_{role}"):
        return option.removesuffix(f"_{role}")
    return values.get("model_engine", values.get(f"{ARR}.actor.model_engine"))


def _lr_schedules(values: dict[str, Any], total_iterations: int) -> dict[str, Any]:
    """Our ``{actor,critic}.optim`` schedule keys for what verl computes from several of its keys together:

    - the warm-up: ``lr_warmup_steps``, or with -1 ``int(lr_warmup_steps_ratio x T)``, T the run's iterations
      (``verl/workers/engine/fsdp/transformer_impl.py::_build_lr_scheduler``); megatron-core's ratio is of its
      ``lr_decay_steps`` when given (``verl/utils/megatron/optimizer.py``); VeOmni's is the ratio's always (its
      ``build_lr_scheduler`` takes no step count);
    - ``warmup_style`` (verl's older name) wins over ``lr_scheduler_type`` when set;
    - the minimum as a ratio: megatron-core's ``min_lr`` and VeOmni's ``lr_min`` are absolute lrs;
    - VeOmni: cosine unless ``lr_scheduler_type`` is given (verl's ``optim/veomni.yaml``), decaying over
      ``int(lr_decay_ratio x T)`` iterations."""
    ours: dict[str, Any] = {}
    for role, section in (("actor", f"{ARR}.actor"), ("critic", "critic")):
        optim, engine = f"{section}.optim", _role_engine(values, role)
        lr = float(values.get(f"{optim}.lr", 1e-6 if role == "actor" else 1e-5))
        steps, ratio = values.get(f"{optim}.lr_warmup_steps"), values.get(f"{optim}.lr_warmup_steps_ratio")
        horizon = total_iterations
        if values.get(f"{optim}.lr_decay_steps") not in (None, "null", -1):
            horizon = int(values[f"{optim}.lr_decay_steps"])
        if engine == "veomni":
            ours[f"{role}.optim.warmup_iterations"] = int(float(ratio or 0) * total_iterations)
            ours[f"{role}.optim.lr_scheduler_type"] = values.get(f"{optim}.lr_scheduler_type", "cosine")
            ours[f"{role}.optim.min_lr_ratio"] = float(values.get(f"{optim}.lr_min", 0.0)) / lr
            decay = int(float(values.get(f"{optim}.lr_decay_ratio", 1.0)) * total_iterations)
            ours[f"{role}.optim.decay_iterations"] = max(decay, ours[f"{role}.optim.warmup_iterations"] + 1)
        elif ratio and (steps is None or int(steps) < 0):
            ours[f"{role}.optim.warmup_iterations"] = int(float(ratio) * horizon)
        style = values.get(f"{optim}.warmup_style")
        if style not in (None, "null", ""):
            ours[f"{role}.optim.lr_scheduler_type"] = style
        if f"{optim}.min_lr" in values:
            ours[f"{role}.optim.min_lr_ratio"] = float(values[f"{optim}.min_lr"]) / lr
    return ours


def _epochs_to_iterations(values: dict[str, Any]) -> int:
    """``trainer.total_epochs`` x batches per epoch (verl's dataloader drops the last partial batch)."""
    files = values.get("data.train_files") or []
    files = [files] if isinstance(files, str) else files
    if not files:
        raise ConfigError(
            "hf verl: trainer.total_epochs needs data.train_files to count the batches of an epoch; give "
            "data.train_files or trainer.total_training_steps"
        )
    rows = sum(_row_count(Path(f).expanduser()) for f in files)
    return int(values["trainer.total_epochs"]) * (rows // int(values["data.train_batch_size"]))


def _row_count(path: Path) -> int:
    """Rows of a prompt file: a parquet file's row count (its footer), a JSON-lines file's non-empty lines.

    Raises:
        ConfigError: the file is missing or of another kind (data.train_files named)."""
    if not path.is_file():
        raise ConfigError(f"data.train_files: {path} is not a file (trainer.total_epochs counts its rows)")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix.lower() in (".jsonl", ".json"):
        with path.open() as lines:
            return sum(1 for line in lines if line.strip())
    raise ConfigError(f"data.train_files: {path} is not .parquet, .jsonl or .json")


def to_verl(config: dict[str, Any]) -> dict[str, Any]:
    """A HybridFlow config (``HybridFlowConfig.model_dump(mode="json")``) in verl's dotted keys: for each of our
    keys, the first `VERL_KEYS` entry that sets it, our value converted by its `to_verl`; ``reward.custom_function``
    split into ``custom_reward_function.path`` and ``.name``. Keys with no verl counterpart (``data.reasoning_gym``,
    ``placement.pools``, ``trainer.mode``, ...) and values verl cannot say (`UNSAID`) are left out."""
    flat = dotted_leaves(config)
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for entry in VERL_KEYS:
        if not entry.ours or "*" in entry.verl or seen.issuperset(entry.ours):
            continue
        seen.update(entry.ours)
        if entry.verl == "custom_reward_function.path" or not all(k in flat for k in entry.ours):
            continue
        ours = tuple(flat[k] for k in entry.ours)
        value = entry.to_verl(ours) if entry.to_verl else ours[0]
        if value is not UNSAID:
            out[entry.verl] = value
    function = flat.get("reward.custom_function")
    if function:
        path, _, name = function.rpartition(":")
        out["custom_reward_function.path"], out["custom_reward_function.name"] = path, name
    return out


def override_value(value: Any) -> str:
    """`value` as an override writes it (YAML flow style on one line: ``[a, b]``, ``null``, ``1.0e-06``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
