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

from hybridflow.engine.config.loading import ConfigError, _yaml_problem, dotted_leaves, parse_overrides
from hybridflow.engine.config.verl_keys import ARR, UNSAID, VERL_KEYS, find_key

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
    and ``hydra`` section dropped: verl's defaults are `VERL_DEFAULTS` here). ``${a.b}`` values are resolved from
    the file's own keys.

    Raises:
        ConfigError: the file is not YAML of sections, or a value interpolates something other than a key of the
            file (``${oc.env:...}`` and the like: write the value)."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of verl's sections (data, actor_rollout_ref, ...)")
    tree.pop("defaults", None)
    tree.pop("hydra", None)
    flat = {k: v for k, v in dotted_leaves(tree).items() if not k.endswith("_target_")}  # Hydra's classes
    for key, value in flat.items():
        if isinstance(value, str) and "${" in value:
            match = re.fullmatch(r"\$\{([\w.]+)\}", value.strip())
            if not match or match.group(1) not in flat:
                raise ConfigError(f"{path}: {key}: {value!r} interpolates what hf verl cannot resolve; write the value")
            flat[key] = flat[match.group(1)]
    return flat


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
    given = dict(VERL_CONFIG_NAMES[config_name]) if config_name else {}
    given.update(read_verl_file(config_file) if config_file else {})
    given.update({k.lstrip("+"): v for k, v in parse_overrides(overrides).items()})
    values = {**VERL_DEFAULTS, **given}
    for key, source in _INHERITED.items():
        if key not in values and source in values:
            values[key] = values[source]
    errors: list[str] = []
    ours: dict[str, Any] = {}
    no_effect: list[tuple[str, str]] = []
    for key, value in values.items():
        try:
            entry = find_key(key)
            ours.update(entry.convert(value))
        except (ConfigError, TypeError, ValueError) as e:
            errors.append(str(e) if isinstance(e, ConfigError) else f"verl key {key}={value!r}: {e}")
            continue
        if not entry.ours and not entry.via and key in given:
            no_effect.append((key, entry.note))
    errors += _cross_checks(values)
    if errors:
        raise ConfigError("hf verl cannot run this command line:\n  " + "\n  ".join(errors))
    if "custom_reward_function.path" in values:
        name = values.get("custom_reward_function.name") or "compute_score"
        ours["reward.custom_function"] = f"{values['custom_reward_function.path']}:{name}"
    if "trainer.total_training_steps" not in given or given["trainer.total_training_steps"] is None:
        ours["trainer.total_iterations"] = _epochs_to_iterations(values)
    for role, section in (("actor", f"{ARR}.actor"), ("critic", "critic")):  # verl's ratio, of the whole run
        steps = values.get(f"{section}.optim.lr_warmup_steps")
        ratio = values.get(f"{section}.optim.lr_warmup_steps_ratio")
        if ratio and (steps is None or int(steps) < 0):
            ours[f"{role}.optim.warmup_iterations"] = int(float(ratio) * int(ours["trainer.total_iterations"]))
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
    max_resp_len = values.get("reward_model.reward_kwargs.max_resp_len")
    if max_resp_len is not None and int(max_resp_len) != int(values["data.max_response_length"]):
        errors.append(
            f"verl key reward_model.reward_kwargs.max_resp_len={max_resp_len} is not supported here: the overlong "
            f"buffer ends at data.max_response_length ({values['data.max_response_length']}); give the same value"
        )
    return errors


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
