"""Configuration: YAML + overrides validated by typed models, errors that name the key."""

import importlib.util
import os
from pathlib import Path

import pytest

from hybridflow.engine.config import ConfigError, HybridFlowConfig, load_config, validate_config
from hybridflow.engine.extensions import engine_tp

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
MINIMAL = ["data.reasoning_gym.name=basic_arithmetic"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path):
    from hybridflow.engine.config import DPOTrainingConfig, RMTrainingConfig, SFTTrainingConfig

    if path.name.startswith("rm_"):  # hf rm train's configs
        assert isinstance(load_config(path, schema=RMTrainingConfig), RMTrainingConfig)
    elif path.name.startswith("dpo_"):  # hf dpo train's configs
        assert isinstance(load_config(path, schema=DPOTrainingConfig), DPOTrainingConfig)
    elif "_sft_" in path.name:  # hf sft train's configs
        assert isinstance(load_config(path, schema=SFTTrainingConfig), SFTTrainingConfig)
    elif "reward_model:" in path.read_text():  # its reward model is the one a user trained: the path is theirs
        with pytest.raises(ConfigError, match="reward_model.path is not set"):
            load_config(path)
        assert isinstance(load_config(path, ["reward_model.path=/rm"]), HybridFlowConfig)
    else:
        assert isinstance(load_config(path), HybridFlowConfig)


BF16_KEYS = ("model.dtype", "rollout.vllm_dtype", "reward_model.dtype", "reward_model.judge.vllm_dtype")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_compute_in_float32_where_bf16_is_emulated(path):
    """No example asks for bf16 outright: each dtype key is float32, ``auto`` or ``native`` (bf16 only on CUDA or a
    CPU with AVX512-BF16/AMX), so every example runs at full speed on a CPU that emulates bf16 (the AMD EPYC: a
    SmolLM2 update 23 times slower in bf16); ``-o KEY=bfloat16`` is the documented override."""
    import yaml

    config = yaml.safe_load(path.read_text())
    for key in BF16_KEYS:
        section = config
        for part in key.split("."):
            section = section.get(part, {}) if isinstance(section, dict) else {}
        assert section in ({}, "float32", "auto", "native"), f"{path.name}: {key}={section}"


def test_overrides_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            *MINIMAL,
            "actor.optim.lr=3e-5",
            "rollout.n=8",
            "actor.use_kl_loss=true",
            'data.reasoning_gym.config={"max_terms": 2}',
        ],
    )
    assert cfg.actor.optim.lr == 3e-5 and cfg.rollout.n == 8 and cfg.actor.use_kl_loss is True
    assert cfg.data.reasoning_gym.config == {"max_terms": 2}


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"actor\.ppo_epoch: unknown key"):
        load_config(None, [*MINIMAL, "actor.ppo_epoch=2"])


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*MINIMAL, "actor.loss_agg_mode=token-average"])
    assert "actor.loss_agg_mode" in str(err.value) and "seq-mean-token-mean" in str(err.value)


def test_ill_typed_value_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        load_config(None, [*MINIMAL, "rollout.n=many"])


def test_missing_data_source_says_what_to_set():
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(None, [])


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size"):
        load_config(None, [*MINIMAL, "data.train_batch_size=6", "actor.ppo_mini_batch_size=4"])


def test_group_estimators_with_one_sample_a_prompt_warn():
    import warnings

    from hybridflow.engine.config import GroupOfOneWarning

    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo"):
        with pytest.warns(GroupOfOneWarning, match="set rollout.n >= 2"):
            load_config(None, [*MINIMAL, "rollout.n=1", f"algorithm.adv_estimator={estimator}"])
    # REINFORCE++ whitens over the batch: one sample per prompt is enough
    with warnings.catch_warnings():
        warnings.simplefilter("error", GroupOfOneWarning)
        assert load_config(None, [*MINIMAL, "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])


def test_estimators_and_policy_losses_come_from_their_registries():
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator.*'ppo2'.*registered.*'reinforce_plus_plus'"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=ppo2"])
    registered = r"registered.*'cispo', 'clip_cov', 'geo_mean', 'gpg', 'gspo', 'kl_cov'"
    with pytest.raises(ConfigError, match=rf"actor.policy_loss.loss_mode.*'gpsO'.*{registered}"):
        load_config(None, [*MINIMAL, "actor.policy_loss.loss_mode=gpsO"])
    cfg = load_config(None, [*MINIMAL, "actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=token-sum"])
    assert cfg.actor.policy_loss.loss_mode == "gspo" and cfg.actor.loss_agg_mode == "token-sum"
    assert load_config(None, [*MINIMAL, "actor.kl_loss_type=k3+"]).actor.kl_loss_type == "k3+"


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["rollout.n"])


def test_data_parallel_batch_sizes_and_nodes_are_checked_up_front():
    cfg = load_config(None, [*MINIMAL, "placement.tasks_per_node=2", "placement.executor=slurm", "placement.nodes=2"])
    assert cfg.placement.world_size == 4 and cfg.pool_of("actor").world_size == 4
    with pytest.raises(ConfigError, match=r"cannot be split evenly over the 3 data-parallel ranks"):
        load_config(None, [*MINIMAL, "placement.tasks_per_node=3"])
    with pytest.raises(ConfigError, match=r"placement.nodes > 1 needs placement.executor: slurm"):
        load_config(None, [*MINIMAL, "placement.nodes=2"])
    earlier = load_config(None, [*MINIMAL, "placement.world_size=2"])  # configs recorded before nodes x tasks
    assert earlier.placement.tasks_per_node == 2 and earlier.placement.world_size == 2
    tis = "algorithm.rollout_correction.rollout_is=token"
    # both built-in rollouts report their log-probs (the hf rollout too: its rollout_log_probs)
    assert load_config(None, [*MINIMAL, tis]).algorithm.rollout_correction.rollout_is == "token"
    assert load_config(None, [*MINIMAL, "rollout.name=vllm", tis]).algorithm.rollout_correction.rollout_is == "token"
    with pytest.raises(ConfigError, match=r"rollout_correction.rollout_is: Input should be 'token' or 'sequence'"):
        load_config(None, [*MINIMAL, "rollout.name=vllm", "algorithm.rollout_correction.rollout_is=geometric"])
    # a run recorded before algorithm.rollout_correction (actor.tis_cap) still loads, with the same correction
    recorded = load_config(None, [*MINIMAL, "rollout.name=vllm"]).model_dump(mode="json")
    capped = {**recorded, "actor": {**recorded["actor"], "tis_cap": 1.5}}
    capped["algorithm"] = {k: v for k, v in recorded["algorithm"].items() if k != "rollout_correction"}
    correction = validate_config(capped).algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("token", 1.5)
    off = validate_config({**capped, "actor": {**capped["actor"], "tis_cap": None}})
    assert (
        off.algorithm.rollout_correction.rollout_is is None
        and "rollout_is" in off.algorithm.rollout_correction.model_fields_set
    )
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert load_config(None, [*MINIMAL, "rollout.name=auto"]).rollout.name == ("vllm" if has_vllm else "hf")
    with pytest.raises(ConfigError, match=r"placement.slurm.gpus: unknown key"):
        load_config(None, [*MINIMAL, "placement.slurm.gpus=1"])


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
def test_parallel_layout_keys_are_checked_and_give_the_layout():
    megatron = [*MINIMAL, "actor.strategy=megatron", "placement.tasks_per_node=8"]
    cfg = load_config(None, [*megatron, "actor.tp=4", "rollout.gen_tp=2", "actor.ppo_mini_batch_size=2"])
    layout = cfg.actor_layout()
    assert (layout.p, layout.t, layout.d, layout.p_g, layout.t_g, layout.d_g) == (1, 4, 2, 1, 2, 2)
    assert cfg.rollout.reshard == "hybridflow"
    assert load_config(None, [*megatron, "actor.tp=2", "actor.pp=2"]).actor_layout().t_g == 2  # gen_tp: actor.tp
    with pytest.raises(ConfigError, match=r"actor.tp, actor.pp, rollout.gen_tp .* need actor.strategy=megatron"):
        load_config(None, [*MINIMAL, "actor.tp=2"])
    with pytest.raises(ConfigError, match=r"8 ranks .* not a multiple of actor.tp x actor.pp = 3"):
        load_config(None, [*megatron, "actor.tp=3"])
    with pytest.raises(ConfigError, match=r"rollout.gen_tp \(3\) must divide the training actor.tp \(4\)"):
        load_config(None, [*megatron, "actor.tp=4", "rollout.gen_tp=3"])
    with pytest.raises(ConfigError, match=r"rollout.gen_pp > 1 .* set rollout.gen_pp=1"):
        load_config(None, [*megatron, "actor.pp=2", "rollout.gen_pp=2"])
    # vLLM beside megatron: an engine tensor-parallel over rollout.gen_tp (default actor.tp) ranks, fed whole
    # replicas by the 3D-HybridEngine (its generation layout t_g = 1)
    vllm_tp = load_config(None, [*megatron, "actor.tp=2", "rollout.name=vllm"])
    assert engine_tp(vllm_tp) == 2 and vllm_tp.actor_layout().t_g == 1
    assert load_config(None, [*megatron, "actor.tp=2", "rollout.name=auto"]).rollout.name == "hf"
    assert load_config(None, [*megatron, "actor.tp=2", "rollout.gen_tp=1", "rollout.name=vllm"]).actor.tp == 2
    with pytest.raises(ConfigError, match=r"set actor.entropy_coeff=0"):
        load_config(None, [*megatron, "actor.entropy_coeff=0.01"])
    fsdp = [*MINIMAL, "actor.strategy=fsdp", "placement.tasks_per_node=4"]
    assert load_config(None, [*fsdp, "actor.tp=2"]).actor.tp == 2
    with pytest.raises(ConfigError, match=r"actor.strategy=fsdp trains with tensor parallelism .* only"):
        load_config(None, [*fsdp, "actor.tp=2", "rollout.gen_tp=1"])
    with pytest.raises(ConfigError, match=r"4 ranks .* not a multiple of actor.tp = 3"):
        load_config(None, [*fsdp, "actor.tp=3"])
    # vLLM tensor-parallel beside fsdp (verl's layout): blocks of gen_tp ranks, the actor itself data parallel
    vllm_fsdp = load_config(None, [*fsdp, "rollout.name=vllm", "rollout.gen_tp=2"])
    assert engine_tp(vllm_fsdp) == 2 and vllm_fsdp.actor_layout().t_g == 1
    with pytest.raises(ConfigError, match=r"trains with tensor parallelism .* \(or set rollout.name=vllm"):
        load_config(None, [*fsdp, "rollout.gen_tp=2"])  # transformers cannot split generation over ranks
    with pytest.raises(ConfigError, match=r"4 ranks .* not a multiple of rollout.gen_tp = 3"):
        load_config(None, [*fsdp, "rollout.name=vllm", "rollout.gen_tp=3"])
    with pytest.raises(ConfigError, match=r"needs actor.tp=1, actor.pp=1"):
        load_config(None, [*fsdp, "rollout.name=vllm", "rollout.gen_tp=4", "actor.tp=2"])
    apart = ['placement.pools={"a": {"roles": ["actor", "ref", "reward"]}, "g": {"roles": ["rollout"]}}']
    # a rollout pool of its own: its engines split over blocks of its own ranks, whatever the actor's layout
    assert engine_tp(load_config(None, [*fsdp, *apart, "rollout.name=vllm", "rollout.gen_tp=2", "actor.tp=2"])) == 2
    with pytest.raises(ConfigError, match=r"rollout pool g's 4 ranks are not a multiple of rollout.gen_tp = 3"):
        load_config(None, [*fsdp, *apart, "rollout.name=vllm", "rollout.gen_tp=3"])
    with pytest.raises(ConfigError, match=r"critic.strategy=megatron runs in the megatron actor's processes"):
        load_config(None, [*MINIMAL, "critic.strategy=megatron"])
    # the mini-batch splits over the actor's data-parallel replicas (8 ranks / (tp 2 x pp 2) = 2), not all ranks
    load_config(None, [*megatron, "actor.tp=2", "actor.pp=2", "actor.ppo_mini_batch_size=1", "rollout.n=2"])
    with pytest.raises(ConfigError, match=r"over the 2 data-parallel ranks .* / \(actor.tp x actor.pp\)"):
        load_config(None, [*megatron, "actor.tp=2", "actor.pp=2", "actor.ppo_mini_batch_size=1", "rollout.n=3"])


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
def test_uneven_micro_batches_are_refused_only_with_megatron_pipelines():
    """A micro-batch size that does not divide a rank's mini-batch leaves a smaller last micro-batch: exact with
    ddp, fsdp and megatron without pipelines (tests/test_data_parallel.py, ``uneven``), refused with megatron at
    ``actor.pp > 1``, whose schedule passes activations between stages in buffers of one size."""
    # issue 57's case: 8 sequences per mini-batch, 4 per rank, micro-batches of 3 and 1
    issue = [*MINIMAL, "placement.tasks_per_node=2", "actor.ppo_mini_batch_size=4", "rollout.n=2"]
    assert load_config(None, [*issue, "actor.ppo_micro_batch_size=3"]).actor.ppo_micro_batch_size == 3
    assert load_config(None, [*issue, "actor.strategy=fsdp", "actor.ppo_micro_batch_size=3"]).actor.strategy == "fsdp"
    # megatron on 4 ranks: tp=2 (pp=1, 2 replicas) is exact as well; pp=2 (2 replicas) is refused
    megatron = [*MINIMAL, "actor.strategy=megatron", "placement.tasks_per_node=4", "actor.ppo_mini_batch_size=4"]
    megatron += ["rollout.n=2", "data.train_batch_size=4"]
    assert load_config(None, [*megatron, "actor.tp=2", "actor.ppo_micro_batch_size=3"]).actor.tp == 2
    message = (
        r"actor.ppo_micro_batch_size=3 does not divide the 4 sequences of each data-parallel rank's mini-batch "
        r"\(actor.ppo_mini_batch_size x rollout.n / data-parallel size = 4 x 2 / 2\), and megatron's pipeline "
        r"schedule \(actor.pp=2\) needs micro-batches of one size: set actor.ppo_micro_batch_size=2 \(the largest "
        r"divisor of 4 up to 3\)"
    )
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*megatron, "actor.pp=2", "actor.ppo_micro_batch_size=3"])
    for micro in (1, 2, 4, 8):  # divisors, and one past the mini-batch (one micro-batch of all 4)
        assert load_config(None, [*megatron, "actor.pp=2", f"actor.ppo_micro_batch_size={micro}"]).actor.pp == 2
    # the old_log_prob pass splits each rank's whole batch (4 x 2 / 2 sequences) alike: refused before any work
    with pytest.raises(
        ConfigError,
        match=r"actor.log_prob_micro_batch_size=3 does not divide the 4 sequences of "
        r"each data-parallel rank's batch \(data.train_batch_size x rollout.n",
    ):
        load_config(
            None, [*megatron, "actor.pp=2", "actor.ppo_micro_batch_size=2", "actor.log_prob_micro_batch_size=3"]
        )
    # a megatron critic runs in the actor's layout: its mini-batch of 4 x 2 / 2 sequences per rank alike
    critic = [*megatron, "actor.pp=2", "actor.ppo_micro_batch_size=2", "algorithm.adv_estimator=gae"]
    critic += ["critic.strategy=megatron", "critic.ppo_mini_batch_size=4"]
    with pytest.raises(ConfigError, match=r"critic.ppo_micro_batch_size=3 does not divide .* set critic.ppo_micro"):
        load_config(None, [*critic, "critic.ppo_micro_batch_size=3"])
    assert load_config(None, [*critic, "critic.ppo_micro_batch_size=2"]).critic.strategy == "megatron"
    with pytest.raises(ConfigError, match=r"critic.forward_micro_batch_size=3 does not divide"):
        load_config(None, [*critic, "critic.ppo_micro_batch_size=2", "critic.forward_micro_batch_size=3"])
    # a critic of its own (ddp) splits unevenly, exactly, beside a pipelined megatron actor
    assert load_config(None, [*critic, "critic.strategy=ddp", "critic.ppo_micro_batch_size=3"]).critic.strategy


def test_given_prompt_files_replace_the_files_reasoning_gym_source(tmp_path, caplog):
    smollm2 = Path(__file__).parent.parent / "examples" / "grpo_smollm2.yaml"
    with caplog.at_level("WARNING"):
        cfg = load_config(smollm2, ["data.train_files=train.parquet", "data.val_files=[a.jsonl, b.jsonl]"])
    assert cfg.data.reasoning_gym is None  # not silently mixed in
    assert cfg.data.train_files == ["train.parquet"]  # one path is a list of one
    assert cfg.data.val_files == ["a.jsonl", "b.jsonl"]
    assert "replaces data.reasoning_gym" in caplog.text
    both = load_config(smollm2, ["data.train_files=train.parquet", "data.reasoning_gym.train_size=100"])
    assert both.data.train_files == ["train.parquet"] and both.data.reasoning_gym.train_size == 100  # asked for
    files = tmp_path / "files.yaml"
    files.write_text("data:\n  train_files: train.parquet\n  val_files: val.parquet\n")
    rg = load_config(files, ["data.reasoning_gym.name=basic_arithmetic"])
    assert rg.data.train_files == [] and rg.data.val_files == [] and rg.data.reasoning_gym.name == "basic_arithmetic"


def test_resume_may_extend_a_run_but_not_change_its_computation():
    from hybridflow.engine.config import resume_config

    stored = load_config(Path(__file__).parent.parent / "examples" / "grpo_tiny.yaml").model_dump(mode="json")
    extended = resume_config(stored, ["trainer.total_iterations=40", "placement.slurm.time_min=30"])
    assert extended.trainer.total_iterations == 40 and extended.placement.slurm.time_min == 30
    for change in ["model.path=smollm2", "data.train_batch_size=8", "algorithm.adv_estimator=rloo"]:
        with pytest.raises(ConfigError, match=rf"cannot change {change.split('=')[0]}: .* hf run"):
            resume_config(stored, [change])


def test_a_cosine_decays_over_the_run_as_first_started_and_only_rl_runs_take_it(tmp_path):
    """``decay_iterations: 0`` is the run's ``trainer.total_iterations``, recorded so: a resume that extends the run
    keeps the curve (the new iterations at the minimum); ``hf sft train`` schedules by optimizer step and refuses it."""
    from hybridflow.engine.config import SFTTrainingConfig, resume_config

    cosine = [*MINIMAL, "trainer.total_iterations=12", "actor.optim.lr_scheduler_type=cosine"]
    cfg = load_config(None, [*cosine, "critic.optim.lr_scheduler_type=cosine", "critic.optim.decay_iterations=5"])
    assert (cfg.actor.optim.decay_iterations, cfg.critic.optim.decay_iterations) == (12, 5)
    assert load_config(None, MINIMAL).actor.optim.decay_iterations == 0  # constant: no horizon
    extended = resume_config(cfg.model_dump(mode="json"), ["trainer.total_iterations=40"])
    assert (extended.trainer.total_iterations, extended.actor.optim.decay_iterations) == (40, 12)
    sft = tmp_path / "sft.yaml"
    sft.write_text("data: {train_files: [/d.parquet]}\noptim: {lr_scheduler_type: cosine}\n")
    with pytest.raises(ConfigError, match="optim.lr_scheduler_type=cosine decays by RL iteration"):
        load_config(sft, schema=SFTTrainingConfig)


# ------------------------------------------------------------------------------------------------ resource pools
PPO = [*MINIMAL, "algorithm.adv_estimator=gae", "actor.use_kl_loss=true"]
POOLS = {
    "actor_rollout": {"roles": ["actor", "rollout"], "tasks_per_node": 2},
    "ref": {"roles": ["ref"]},
    "critic": {"roles": ["critic"], "slurm": {"cpus_per_task": 2}},
}


def _pools(pools: dict, *extra: str) -> HybridFlowConfig:
    import json

    return load_config(None, [*PPO, f"placement.pools={json.dumps(pools)}", *extra])


def test_pools_partition_the_roles_with_their_own_ranks_and_slurm_resources():
    cfg = _pools(POOLS, "placement.tasks_per_node=1", "placement.slurm.cpus_per_task=4")
    pools = cfg.pools()
    assert list(pools) == ["actor_rollout", "ref", "critic"]
    assert pools["actor_rollout"].roles == ("actor", "rollout", "reward")  # the score function joins the rollout
    assert (pools["actor_rollout"].world_size, pools["ref"].world_size) == (2, 1)  # its own, else placement's
    assert (pools["critic"].slurm.cpus_per_task, pools["ref"].slurm.cpus_per_task) == (2, 4)
    assert cfg.pool_of("critic").name == "critic" and cfg.actor_layout().d == 2
    # the shorthand layouts are pools too; colocate=false without a critic or reward model is one pool
    assert list(load_config(None, PPO).pools()) == ["actor_rollout_ref"]
    split = load_config(None, [*PPO, "placement.colocate=false", "placement.critic_tasks_per_node=2"])
    assert {n: (p.roles, p.world_size) for n, p in split.pools().items()} == {
        "actor_rollout_ref": (("actor", "rollout", "reward", "ref"), 1),
        "critic": (("critic",), 2),
    }
    assert list(load_config(None, [*MINIMAL, "placement.colocate=false"]).pools()) == ["actor_rollout_ref"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"ref": {"roles": ["ref", "judge"]}},
            r"placement.pools.ref.roles: unknown role\(s\) 'judge'; roles are actor",
        ),
        ({"ref": {"roles": ["ref", "critic"]}}, r"placement.pools: role 'critic' is in pools ref and critic"),
        ({"ref": None}, r"placement.pools: role 'ref' is in no pool; add it to the roles of one pool"),
        ({"ref": {"roles": []}}, r"placement.pools.ref.roles: List should have at least 1 item"),
        ({"ref": {"roles": ["ref"], "tasks_per_node": 0}}, r"placement.pools.ref.tasks_per_node: .*greater than or"),
        (  # apart only with an engine fed published weights (tests/test_rollout_pool.py)
            {"actor_rollout": {"roles": ["actor"]}, "gen": {"roles": ["rollout"]}},
            r"rollout \(pool gen\) apart from actor \(pool actor_rollout\) needs .*rollout.name=vllm \(got 'hf'\)",
        ),
        (
            {"rm": {"roles": ["reward_model"]}},
            r"placement.pools.rm: this run uses none of its roles .*reward_model.enable",
        ),
        ({"ref": {"roles": ["ref"], "slurm": {"gpus": 1}}}, r"placement.pools.ref.slurm.gpus: unknown key"),
        ({"ref": {"roles": ["ref"], "nodes": 2}}, r"placement.pools.ref.nodes > 1 needs placement.executor: slurm"),
    ],
)
def test_bad_pools_are_refused_naming_the_key(change, message):
    pools = {**POOLS, **change}
    with pytest.raises(ConfigError, match=message):
        _pools({name: pool for name, pool in pools.items() if pool is not None}, "rollout.name=hf")


def test_pools_replace_the_colocate_shorthand_and_are_not_for_reward_model_training():
    from hybridflow.engine.config import RMTrainingConfig

    with pytest.raises(ConfigError, match=r"placement.pools replaces placement.critic_tasks_per_node"):
        _pools(POOLS, "placement.critic_tasks_per_node=2")
    with pytest.raises(ConfigError, match=r"critic.strategy=megatron runs in the megatron actor's processes"):
        _pools(POOLS, "critic.strategy=megatron")
    with pytest.raises(ConfigError, match=r"hf rm train runs one data-parallel worker group: remove placement.pools"):
        load_config(
            None,
            ["data.train_files=[p.jsonl]", 'placement.pools={"a": {"roles": ["reward_model"]}}'],
            schema=RMTrainingConfig,
        )


def test_resume_may_move_a_pools_slurm_job_and_its_concurrency_but_not_its_ranks():
    from hybridflow.engine.config import resume_config

    stored = _pools(POOLS).model_dump(mode="json")
    moved = resume_config(stored, ["placement.pools.critic.slurm.time_min=30", "placement.concurrent=false"])
    assert moved.pools()["critic"].slurm.time_min == 30 and moved.placement.concurrent is False
    with pytest.raises(ConfigError, match=r"cannot change placement.pools.critic.tasks_per_node: .* hf run"):
        resume_config(stored, ["placement.pools.critic.tasks_per_node=2"])


def test_the_old_log_prob_stage_is_skipped_only_for_an_on_policy_update():
    """One optimizer step per iteration and nothing reading the old log-probs before the update: skipped (the main
    job); several mini-batches, several epochs, the KL in the reward, or actor.recompute_log_prob: run."""
    main = Path(__file__).parent.parent / "examples" / "grpo_smollm2.yaml"
    assert load_config(main).skips_old_log_prob()
    for change in (
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_epochs=2",
        "algorithm.use_kl_in_reward=true",
        "actor.recompute_log_prob=true",
    ):
        assert not load_config(main, [change]).skips_old_log_prob(), change


def test_an_overlong_buffer_must_fit_below_the_response_limit():
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len=64 must be below rollout.response_length=64"):
        load_config(None, [*MINIMAL, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64"])
    cfg = load_config(None, [*MINIMAL, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16"])
    assert cfg.reward.overlong_buffer.penalty == 1.0


def test_remax_needs_sampled_responses_to_compare_with_the_greedy_one():
    with pytest.raises(ConfigError, match=r"rollout.temperature=0 samples the greedy response itself"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=remax", "rollout.temperature=0"])
    cfg = load_config(None, [*MINIMAL, "algorithm.adv_estimator=remax", "rollout.n=1"])  # ReMax's own setting: n=1
    assert "critic" not in cfg.roles()


def test_a_group_of_one_response_is_scored_as_verl_does():
    """verl's rule for a group of one (mean 0, std 1): the advantage is the score."""
    import numpy as np
    import torch
    from torch.testing import assert_close

    from hybridflow.engine.algorithms.estimators import get_adv_estimator_fn

    scores, mask = torch.tensor([[0.0, 1.0], [0.0, -2.0]]), torch.ones(2, 2)
    for name in ("grpo", "rloo"):
        advantages, _ = get_adv_estimator_fn(name)(scores, mask, index=np.array(["a", "b"], dtype=object))
        assert_close(advantages, torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), atol=1e-5, rtol=0)


def test_dynamic_sampling_needs_groups_and_owns_gen_batch_size():
    dapo = [*MINIMAL, "algorithm.filter_groups.enable=true"]
    with pytest.raises(ConfigError, match=r"with rollout.n=1 every group is one response: set rollout.n >= 2"):
        load_config(None, [*dapo, "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])
    with pytest.raises(ConfigError, match=r"filter_groups is for group estimators .*, not remax"):
        load_config(None, [*dapo, "algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match=r"data.gen_batch_size sets the prompts of each draw of dynamic sampling"):
        load_config(None, [*MINIMAL, "data.gen_batch_size=16"])
    cfg = load_config(None, [*dapo, "data.gen_batch_size=16"])
    assert cfg.prompts_per_draw() == 16 and cfg.algorithm.filter_groups.metric == "acc"


def test_a_config_extends_its_defaults_section_by_section(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "data: {reasoning_gym: {name: basic_arithmetic}, train_batch_size: 8}\nactor: {ppo_mini_batch_size: 8}\n"
    )
    (tmp_path / "dapo.yaml").write_text(
        "defaults: [base.yaml]\ndata: {gen_batch_size: 12}\nalgorithm: {filter_groups: {enable: true}}\n"
    )
    cfg = load_config(tmp_path / "dapo.yaml", ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    assert (cfg.data.reasoning_gym.name, cfg.data.gen_batch_size, cfg.data.train_batch_size) == (
        "basic_arithmetic",
        12,
        4,
    )
    assert cfg.algorithm.filter_groups.enable
    (tmp_path / "base.yaml").write_text("defaults: dapo.yaml\n")
    with pytest.raises(ConfigError, match=r"defaults entry dapo.yaml extends itself"):
        load_config(tmp_path / "dapo.yaml")
    (tmp_path / "lost.yaml").write_text("defaults: [nowhere.yaml]\n")
    with pytest.raises(ConfigError, match=r"defaults entry nowhere.yaml is not a file"):
        load_config(tmp_path / "lost.yaml")


def test_safe_rlhf_needs_its_cost_source_and_limit_and_a_ddp_or_fsdp_critic():
    cost = "reward.cost_function=costs.py:length"
    with pytest.raises(ConfigError, match=r"algorithm.cost_limit=0.5 needs a cost source: set reward.cost_function"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=gae", "algorithm.cost_limit=0.5"])
    with pytest.raises(ConfigError, match=r"reward.cost_function=costs.py:length is read only by Safe-RLHF"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=gae", cost])
    safe = [*MINIMAL, "algorithm.cost_limit=0.5", cost]
    with pytest.raises(ConfigError, match=r"set algorithm.adv_estimator=gae, not grpo"):
        load_config(None, safe)
    megatron = ["actor.strategy=megatron", "critic.strategy=megatron"]
    with pytest.raises(ConfigError, match=r"cost critic is built for ddp and fsdp critics: set critic.strategy"):
        load_config(None, [*safe, "algorithm.adv_estimator=gae", *megatron])
    cfg = load_config(None, [*safe, "algorithm.adv_estimator=gae"])
    assert cfg.safe_rlhf() and "critic" in cfg.roles() and not load_config(None, MINIMAL).safe_rlhf()
    model = "reward_model.cost_path=cost_rm"  # a cost model instead: the reward_model role hosts it
    cfg = load_config(None, [*MINIMAL, "algorithm.adv_estimator=gae", "algorithm.cost_limit=0.5", model])
    assert cfg.safe_rlhf() and "reward_model" in cfg.roles() and not cfg.reward_model.enable
    with pytest.raises(ConfigError, match=r"reward.cost_function and reward_model.cost_path are both set"):
        load_config(None, [*safe, "algorithm.adv_estimator=gae", model])
    with pytest.raises(ConfigError, match=r"reward_model.cost_path=cost_rm is read only by Safe-RLHF"):
        load_config(None, [*MINIMAL, "algorithm.adv_estimator=gae", model])


def test_only_the_pool_hosting_a_vllm_rollout_has_its_fork_servers_import_vllm():
    """`group_spec`'s ``vllm`` (a Slurm node's fork server imports vLLM's engine modules, `hf run`'s local one too):
    set for the pool that hosts a vLLM rollout, not for the others, nor for an hf rollout's."""
    import json

    from hybridflow.flows.groups import builds_vllm_engines, group_spec

    tiny = Path(__file__).parent.parent / "examples" / "grpo_tiny.yaml"
    pools = json.dumps({"train": {"roles": ["actor", "ref", "reward"]}, "generate": {"roles": ["rollout"]}})
    apart = load_config(tiny, ["rollout.name=vllm", f"placement.pools={pools}"])
    assert {name: group_spec(apart, pool).vllm for name, pool in apart.pools().items()} == {
        "train": False,
        "generate": True,
    }
    assert builds_vllm_engines(apart)
    hf = load_config(tiny, ["rollout.name=hf"])
    assert not builds_vllm_engines(hf) and not any(group_spec(hf, pool).vllm for pool in hf.pools().values())
