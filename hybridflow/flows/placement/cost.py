"""The cost model: seconds per stage and bytes per device of one model under one parallel strategy. Analytical, after
the HybridFlow paper's simulator (section 6): FLOPs over achieved FLOP/s for compute-bound work (prefill, forward and
backward passes), bytes over achieved bandwidth for memory-bound work (decoding: every step reads the weight shard
and the KV cache) and for collectives (ring all-reduce moves 2(n-1)/n of the buffer) and a pipeline's sends between
stages (over the network once a replica's stages span nodes), plus a pipeline bubble of (p-1)/m (GPipe/1F1B, m
micro-batches), plus fixed costs the profile fits on the machine (per stage, per decoding
step, and per token per layer of a forward pass: the work beyond the matmuls that small models pay). FLOPs: 2 per
weight per token forward, 6 training (Kaplan et al. 2020, eq. 2.1), and causal attention's 2·s·h per layer per token
forward. Memory: 16 bytes per trained parameter (fp32 master weights, gradients and two Adam moments; Rajbhandari et
al. 2020, ZeRO section 3.1), activations 34·s·b·h bytes per layer in bf16 (Korthikanti et al. 2022, eq. 1 without the
attention-score term, which flash attention does not store), the KV cache 2·layers·kv_heads·head_dim bytes per token,
and the 3D-HybridEngine's generation shard M/t_g beside the training shard M/(t·p) (HybridFlow table 2: no redundant
copy). The rollout decodes as many sequences at once as its KV cache has room for beside what its pool holds
(`kv_room_batch`: colocation's cost)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hybridflow.engine.flops import needed_flops
from hybridflow.engine.shapes import ModelShape
from hybridflow.flows.placement.hardware import HardwareProfile

TRAINED_BYTES_PER_PARAM = 16  # fp32 weights (or master copy), fp32 gradients, Adam m and v
LOGIT_BYTES = 4  # log-probs are taken from fp32 logits


@dataclass(frozen=True)
class Workload:
    """One iteration's work, from the run config. Lengths in tokens; micro-batches in sequences."""

    sequences: int  # data.train_batch_size x rollout.n
    prompt_length: int
    response_length: int
    actor_steps: int  # optimizer steps per iteration: actor.ppo_epochs x train_batch_size / ppo_mini_batch_size
    critic_steps: int
    actor_epochs: int = 1
    critic_epochs: int = 1
    train_micro_batch: int = 8
    critic_micro_batch: int = 8
    infer_micro_batch: int = 16
    gen_micro_batch: int = 32  # sequences a replica decodes at once (its KV cache holds them)
    old_log_prob: bool = True  # the actor's old_log_prob stage runs (false: skipped, an on-policy update)
    generated: int | None = None  # sequences generated (DAPO: a draw of data.gen_batch_size prompts); None: sequences
    greedy: int = 0  # ReMax: greedy responses generated besides (stage gen_max), one per prompt
    samples: int = 1  # rollout.n: sequences per prompt
    prompt_mean: float | None = None  # mean prompt tokens (packed passes and prefill); None: prompt_length
    response_mean: float | None = None  # mean response tokens (packed passes); None: response_length
    actor_shares_prompts: bool = True  # actor.shares_prompts: the actor's and the ref's packed passes
    critic_shares_prompts: bool = True  # critic.shares_prompts
    cost_critic: bool = False  # Safe-RLHF: a cost critic beside the critic, on its devices, the same work again
    scorers: int = 1  # sequence classifiers of the rm_score stage: the reward model, Safe-RLHF's cost model
    lora_rank: int = 0  # model.lora_rank: the actor trains an adapter on its frozen weights; ref is the actor's model
    rollout_wakes: int = 0  # wakes an iteration of a rollout engine with weights of its own (vLLM), asleep between

    @property
    def seq_length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def tokens(self) -> int:
        """Tokens of every sequence of the iteration (prompt and response), padded to the longest."""
        return self.sequences * self.seq_length

    @property
    def mean_prompt(self) -> float:
        return self.prompt_length if self.prompt_mean is None else self.prompt_mean

    @property
    def mean_response(self) -> float:
        return self.response_length if self.response_mean is None else self.response_mean

    def packed_groups(self, shared: bool, micro_batch: int) -> tuple[float, tuple[float, list[float]]]:
        """The packed rows of one pass (`hybridflow.engine.packing.pack_rows`: no padding; with `shared`, a prompt
        once for those of its samples in the same micro-batch of `micro_batch` sequences), as (copies, group): the
        number of prompt copies computed and one copy's (prompt tokens, [response tokens per sample]) at the mean
        lengths."""
        k = min(self.samples, micro_batch) if shared else 1
        return self.sequences / k, (self.mean_prompt, [self.mean_response] * k)

    @classmethod
    def from_config(
        cls,
        cfg,
        prompt_length: int | None = None,
        response_length: int | None = None,
        prompt_mean: float | None = None,
        response_mean: float | None = None,
    ) -> Workload:
        """From a `HybridFlowConfig`: prompts of ``data.max_prompt_length`` tokens and responses of
        ``rollout.response_length`` (the longest the rollout produces) unless given (e.g. as measured); the mean
        lengths, which packed passes compute, are the longest unless given."""
        from hybridflow.engine.algorithms.estimators import uses_greedy_baseline

        prompts = cfg.data.train_batch_size
        # vLLM keeps weights of its own, asleep in host memory while the models train, woken for the weight sync and
        # for each generation (`hybridflow.engine.rollout.vllm`): the sampled one and ReMax's greedy one
        generations = 1 + int(uses_greedy_baseline(cfg.algorithm.adv_estimator))
        return cls(
            sequences=prompts * cfg.rollout.n,
            generated=cfg.prompts_per_draw() * cfg.rollout.n,  # DAPO: one draw (more when groups are dropped)
            greedy=prompts if uses_greedy_baseline(cfg.algorithm.adv_estimator) else 0,
            prompt_length=prompt_length or cfg.data.max_prompt_length,
            response_length=response_length or cfg.rollout.response_length,
            actor_steps=cfg.actor.ppo_epochs * (prompts // cfg.actor.ppo_mini_batch_size),
            critic_steps=cfg.critic.ppo_epochs * (prompts // cfg.critic.ppo_mini_batch_size),
            samples=cfg.rollout.n,
            prompt_mean=prompt_mean,
            response_mean=response_mean,
            actor_shares_prompts=cfg.actor.share_prompts,
            critic_shares_prompts=cfg.critic.share_prompts,
            cost_critic=cfg.safe_rlhf(),
            scorers=max(1, int(cfg.reward_model.enable) + int(cfg.reward_model.cost_path is not None)),
            actor_epochs=cfg.actor.ppo_epochs,
            critic_epochs=cfg.critic.ppo_epochs,
            train_micro_batch=cfg.actor.ppo_micro_batch_size,
            critic_micro_batch=cfg.critic.ppo_micro_batch_size,
            infer_micro_batch=cfg.actor.log_prob_micro_batch_size,
            gen_micro_batch=cfg.rollout.micro_batch_size,
            old_log_prob=not cfg.skips_old_log_prob(),
            lora_rank=cfg.model.lora_rank,
            rollout_wakes=generations + 1 if cfg.rollout.name == "vllm" else 0,
        )


@dataclass(frozen=True)
class Strategy:
    """A model's parallel strategy on its pool: ``ddp`` (a whole copy per rank), ``fsdp`` (sharded over the ranks),
    ``megatron`` (tensor x pipeline x data parallel); for the actor also the generation tensor-parallel size t_g,
    the rollout's batch: sequences a replica decodes at once (0: the workload's ``gen_micro_batch``; fewer where the
    pool's memory leaves its KV cache no room for that many, `kv_room_batch`), and for a megatron mixture-of-experts
    actor the expert-parallel size ``ep`` (``actor.ep``; experts split as the dense layers over TP, and over ``ep``
    of the data-parallel ranks, which the alltoall dispatcher links)."""

    kind: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gen_tp: int = 1
    gen_batch: int = 0
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def generation_tp(self) -> int:
        """t_g: the ranks one rollout replica's tensor-parallel group spans (1 but for megatron's `gen_tp`)."""
        return self.gen_tp if self.kind == "megatron" else 1

    @property
    def rollout_replicas(self) -> int:
        """d_g x d: rollout replicas generating at once (devices / t_g)."""
        return self.devices // self.generation_tp

    def label(self) -> str:
        batch = f" gen-batch{self.gen_batch}" if self.gen_batch else ""
        if self.kind != "megatron":
            return f"{self.kind} x{self.dp}{batch}"
        gen = f" gen-tp{self.gen_tp}" if self.gen_tp != self.tp else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"megatron tp{self.tp} pp{self.pp} dp{self.dp}{ep}{gen}{batch}"


@dataclass
class ModelCost:
    """A model's estimates under one strategy: seconds per stage (by timing name), bytes per device held for the
    whole iteration (`static_bytes`) and held only while a stage runs (`transient_bytes`, by stage)."""

    stage_s: dict[str, float]
    static_bytes: float
    transient_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.stage_s.values())

    @property
    def peak_bytes(self) -> float:
        return self.static_bytes + max(self.transient_bytes.values(), default=0.0)


def _bandwidth(group: int, spans_nodes: bool, hw: HardwareProfile) -> float:
    link = hw.inter_node_bandwidth if spans_nodes else hw.intra_node_bandwidth
    return link * hw.comm_efficiency


def _all_reduce_s(nbytes: float, group: int, spans_nodes: bool, hw: HardwareProfile) -> float:
    """Ring all-reduce of `nbytes` over `group` devices: 2(n-1)/n x bytes over the link, plus its latency."""
    if group <= 1:
        return 0.0
    return hw.collective_latency_s + 2 * (group - 1) / group * nbytes / _bandwidth(group, spans_nodes, hw)


def _all_gather_s(nbytes: float, group: int, spans_nodes: bool, hw: HardwareProfile) -> float:
    """All-gather (or reduce-scatter) of a `nbytes` buffer over `group` devices: (n-1)/n x bytes."""
    if group <= 1:
        return 0.0
    return hw.collective_latency_s + (group - 1) / group * nbytes / _bandwidth(group, spans_nodes, hw)


def dispatch_s(shape: ModelShape, s: Strategy, replica_tokens: float, hw: HardwareProfile, spans: bool) -> float:
    """One forward pass's token dispatch of a mixture-of-experts model under expert parallelism (``s.ep`` > 1,
    megatron-core's alltoall dispatcher): in each MoE layer a rank sends each of its tokens' `top_k` copies
    ([hidden] each) that go to experts on the other ``ep - 1`` ranks, a share (ep - 1) / ep, and receives their
    outputs back: two all-to-alls of ``tokens x k x hidden x (ep - 1) / ep`` bytes a rank, over the link, plus their
    latency. A rank's tokens are its replica's over the TP ranks (sequence parallelism splits them). 0 without
    expert parallelism."""
    if s.ep <= 1 or shape.experts <= 1:
        return 0.0
    nbytes = replica_tokens / s.tp * shape.top_k * shape.hidden * hw.dtype_bytes * (s.ep - 1) / s.ep
    one = hw.collective_latency_s + nbytes / _bandwidth(s.ep, spans, hw)
    return 2 * (shape.layers / s.pp) * one


TRAIN_CALL_OVERHEADS = 4
"""A forward and backward call through a layer costs this many forward calls' fixed overhead
(`HardwareProfile.layer_call_overhead_s`): measured on an H100, 2.28 against 0.59 ms per layer of Llama 7B
(`benchmarks/gpu_efficiency.py`; the backward pass launches about twice the forward's kernels, through autograd)."""


def matmul_params(shape: ModelShape, head: str) -> int:
    """Weights a token's forward pass multiplies with: the blocks (an MoE block's top-k experts, router and shared
    expert: `ModelShape.active_layer_params`) and the output head (not the embedding lookup)."""
    out = shape.vocab * shape.hidden if head == "lm" else shape.hidden
    return shape.layers * shape.active_layer_params + out


def forward_flops(shape: ModelShape, head: str, tokens: float, seq_length: int) -> float:
    """FLOPs of a forward pass over `tokens` tokens in sequences of `seq_length`: 2 per weight per token plus causal
    attention (QK^T and AV: 2·s·h per layer per token)."""
    return tokens * (2 * matmul_params(shape, head) + 2 * shape.layers * seq_length * shape.hidden)


def estimate(
    role: str,
    shape: ModelShape,
    strategy: Strategy,
    workload: Workload,
    hw: HardwareProfile,
    gpus_per_node: int,
) -> ModelCost:
    """Seconds per stage and bytes per device of `role`'s model (``actor``, ``critic``, ``ref``, ``reward_model``,
    ``teacher``)
    with `strategy` on ``strategy.devices`` devices of nodes with `gpus_per_node` devices each. The ddp and fsdp
    passes of the actor, critic and ref compute packed rows (`Workload.packed_groups`: the mean lengths, a prompt
    once per micro-batch for its samples); megatron and the reward model compute every sequence padded to the
    longest prompt and response. Activation and logit memory is sized for the longest."""
    head = "lm" if role in ("actor", "ref", "teacher") else "value"
    w = hw.dtype_bytes
    params = shape.params(head)
    s, t, p, d = strategy, strategy.tp, strategy.pp, strategy.dp
    devices = s.devices
    spans = devices > gpus_per_node  # data-parallel groups cross nodes; tensor-parallel groups stay in one
    model_shards = t * p if s.kind == "megatron" else (d if s.kind == "fsdp" else 1)
    # expert parallelism splits the routed experts ep ways more (megatron: experts over tp x ep x pp ranks)
    expert_share = shape.expert_params / params * (1 - 1 / s.ep) if s.kind == "megatron" and s.ep > 1 else 0.0
    ep_spans = t * s.ep > gpus_per_node  # an expert group beyond a node: its all-to-alls cross the network
    seq = workload.seq_length
    packed = s.kind != "megatron" and role != "reward_model"  # megatron and the reward model pad to the longest
    shared = workload.critic_shares_prompts if role == "critic" else workload.actor_shares_prompts
    stage_s: dict[str, float] = {}
    transient: dict[str, float] = {}

    def pass_work(micro_batch: int) -> tuple[float, float]:
        """FLOPs and tokens of one forward pass over the iteration's sequences in micro-batches of `micro_batch`."""
        if not packed:
            return forward_flops(shape, head, workload.tokens, seq), workload.tokens
        copies, group = workload.packed_groups(shared, micro_batch)
        return copies * needed_flops(shape, [group], head), copies * (group[0] + sum(group[1]))

    stage_link_crosses = t * p > gpus_per_node  # pipeline stages fill a node tp ranks at a time, then the next

    def p2p_s(micro_batch: int, flushes: int, micro_batches: int) -> float:
        """Pipeline point-to-point sends of one pass on the critical path: each of the m micro-batches and the
        p - 1 of each flush's fill hand a micro-batch's activations [micro_batch, seq, hidden] to the next stage,
        split over the t ranks of a stage (Megatron's scatter-gather; Narayanan et al. 2021, section 4.1), over
        NVLink or, once a replica's stages span nodes, the network."""
        if p == 1:
            return 0.0
        nbytes = micro_batch * seq * shape.hidden * w / t
        one = hw.collective_latency_s + nbytes / _bandwidth(2, stage_link_crosses, hw)
        return (micro_batches + flushes * (p - 1)) * one

    def layer_tokens_s(tokens: float) -> float:
        """The per-token per-layer cost of one forward pass over `tokens` tokens, on one replica's share."""
        return tokens / d * (shape.layers / p) * hw.layer_token_overhead_s

    def layer_calls_s(calls: int) -> float:
        """The fixed cost of `calls` forward calls through one rank's layers (`HardwareProfile.layer_call_overhead_s`:
        what makes a call of few tokens per device reach a small share of the peak)."""
        return calls * (shape.layers / p) * hw.layer_call_overhead_s

    def forward_s(micro_batch: int) -> float:
        flops, tokens = pass_work(micro_batch)
        replica_tokens = tokens / d
        micro_batches = max(1, math.ceil(workload.sequences / d / micro_batch))
        compute = flops / (devices * hw.flops * hw.infer_efficiency) + layer_tokens_s(tokens)
        compute += layer_calls_s(micro_batches)
        bubble = 1 + (p - 1) / micro_batches
        comm = 2 * (shape.layers / p) * _all_reduce_s(replica_tokens * shape.hidden * w, t, False, hw)
        comm += p2p_s(micro_batch, 1, micro_batches)
        comm += dispatch_s(shape, s, replica_tokens, hw, ep_spans)
        if s.kind == "fsdp":
            comm += micro_batches * _all_gather_s(params * w, d, spans, hw)
        return compute * bubble + comm + hw.stage_overhead_s

    def logits_bytes(micro_batch: int) -> float:
        width = shape.vocab if head == "lm" else 1
        return micro_batch * seq * (width * LOGIT_BYTES + 8 * shape.hidden * w) / t

    lora = role == "actor" and workload.lora_rank > 0
    trained = shape.lora_params(workload.lora_rank) if lora else params  # what gets gradients and Adam states
    if role in ("actor", "critic"):
        # LoRA: the frozen weights stay fp32 as loaded, with no gradients or optimizer states
        frozen_bytes = params * 4 if lora else 0
        static = (frozen_bytes + trained * TRAINED_BYTES_PER_PARAM) / model_shards * (1 - expert_share)
        epochs = workload.actor_epochs if role == "actor" else workload.critic_epochs
        steps = workload.actor_steps if role == "actor" else workload.critic_steps
        micro = workload.train_micro_batch if role == "actor" else workload.critic_micro_batch
        flops, tokens = pass_work(micro)
        replica_tokens = tokens / d
        micro_batches = max(1, math.ceil(workload.sequences / d / micro / max(1, steps // epochs)))
        passes = 2 if lora else 3  # forward, input gradients, weight gradients (none for frozen weights)
        calls = math.ceil(workload.sequences / d / micro)  # micro-batches of one epoch on one replica
        per_pass = flops / (devices * hw.flops * hw.train_efficiency) + layer_tokens_s(tokens)
        compute = epochs * (passes * per_pass + TRAIN_CALL_OVERHEADS * layer_calls_s(calls))
        compute *= 1 + (p - 1) / micro_batches
        comm = 4 * epochs * (shape.layers / p) * _all_reduce_s(replica_tokens * shape.hidden * w, t, False, hw)
        comm += 2 * epochs * p2p_s(micro, max(1, steps // epochs), calls)  # activations on, gradients back
        comm += 2 * epochs * dispatch_s(shape, s, replica_tokens, hw, ep_spans)  # the backward's all-to-alls too
        if s.kind == "fsdp":
            gathers = epochs * calls
            comm += gathers * 2 * _all_gather_s(params * w, d, spans, hw) + steps * _all_gather_s(
                trained * 4, d, spans, hw
            )
        elif expert_share:  # dense gradients over the d replicas, each expert's over the d / ep holding it
            dense = trained * (1 - shape.expert_params / params)
            comm += steps * _all_reduce_s(dense / (t * p) * 4, d, spans, hw)
            comm += steps * _all_reduce_s(shape.expert_params / (t * p * s.ep) * 4, d // s.ep, spans, hw)
        else:
            comm += steps * _all_reduce_s(trained / (t * p) * 4, d, spans, hw)
        optimizer = steps * 2 * trained * TRAINED_BYTES_PER_PARAM / model_shards / hw.memory_bandwidth
        update = "update_actor" if role == "actor" else "update_critic"
        stage_s[update] = compute + comm + optimizer + hw.stage_overhead_s
        activations = micro * seq * shape.hidden * shape.layers * 34 * (w / 2) / t
        transient[update] = activations + logits_bytes(micro)
        infer = "old_log_prob" if role == "actor" else "values"
        if role == "critic" or workload.old_log_prob:
            stage_s[infer] = forward_s(workload.infer_micro_batch)
            transient[infer] = logits_bytes(workload.infer_micro_batch)
    else:
        # LoRA's reference is the actor's model with the adapter off: no weights of its own (it shares the pool)
        static = 0.0 if role == "ref" and workload.lora_rank > 0 else params * w / model_shards
        stage = {"ref": "ref", "teacher": "teacher"}.get(role, "rm_score")  # forward-only models
        stage_s[stage] = forward_s(workload.infer_micro_batch)
        gathered = params * w * (1 - 1 / d) if s.kind == "fsdp" else 0.0  # fsdp scores with whole weights
        transient[stage] = logits_bytes(workload.infer_micro_batch) + gathered

    twins = 2 if role == "critic" and workload.cost_critic else workload.scorers if role == "reward_model" else 1
    if twins > 1:  # Safe-RLHF: the cost critic (cost model) beside the critic (reward model), in the same call
        stage_s = {stage: twins * seconds - (twins - 1) * hw.stage_overhead_s for stage, seconds in stage_s.items()}
        static *= twins
    if role == "actor":
        generated = replace(workload, sequences=workload.generated or workload.sequences)
        stage_s["gen"], transient["gen"] = _generation(shape, s, generated, hw, gpus_per_node)
        stage_s["gen"] += engine_swap_s(shape, s, workload, hw)  # the weight sync's wake and the generations'
        if workload.greedy:
            greedy = replace(workload, sequences=workload.greedy)
            stage_s["gen_max"], transient["gen_max"] = _generation(shape, s, greedy, hw, gpus_per_node)
    return ModelCost(stage_s, static, transient)


def keeps_engine_weights(workload: Workload, hw: HardwareProfile) -> bool:
    """Whether the rollout is an engine with weights of its own (vLLM: ``workload.rollout_wakes``) on a device with a
    host link (``hw.host_bandwidth``): on a CPU the engine never sleeps and its weights are the host's."""
    return bool(workload.rollout_wakes and hw.host_bandwidth)


def generation_weights_bytes(shape: ModelShape, s: Strategy, workload: Workload, hw: HardwareProfile) -> float:
    """Bytes per device the rollout's weights take beyond the training shard while it generates: a rollout engine's own
    copy (vLLM: ``workload.rollout_wakes``, on a device with a host link), whole or its t_g-th; else the
    3D-HybridEngine's generation shard M/t_g beside the training shard M/(t·p) (HybridFlow table 2: the training shard
    is reused, so only the difference is new), or, for fsdp, the whole weights gathered from the shards."""
    params = shape.params("lm") * hw.dtype_bytes
    if keeps_engine_weights(workload, hw):
        return params / s.generation_tp
    if s.kind == "megatron":
        return params * (1 / s.gen_tp - 1 / (s.tp * s.pp)) if s.tp * s.pp > s.gen_tp else 0.0
    return params * (1 - 1 / s.dp) if s.kind == "fsdp" else 0.0


def engine_swap_s(shape: ModelShape, s: Strategy, workload: Workload, hw: HardwareProfile) -> float:
    """Seconds an iteration a rollout engine with weights of its own spends putting them to sleep and waking them:
    each of ``workload.rollout_wakes`` wakes copies its weight shard from pinned host memory to the device and the
    sleep after it copies it back (vLLM's ``sleep(level=1)`` / ``wake_up``), over ``hw.host_bandwidth``. What sharing
    a pool with training costs such a rollout; 0 where the device is the host (``host_bandwidth`` 0)."""
    if not keeps_engine_weights(workload, hw):
        return 0.0
    return workload.rollout_wakes * 2 * shape.params("lm") * hw.dtype_bytes / s.generation_tp / hw.host_bandwidth


def kv_bytes_per_sequence(shape: ModelShape, s: Strategy, workload: Workload, hw: HardwareProfile) -> float:
    """KV-cache bytes per device one sequence of prompt + response tokens takes (its keys and values in every layer,
    split over the generation's t_g ranks)."""
    return workload.seq_length * shape.kv_bytes_per_token(hw.dtype_bytes) / s.generation_tp


def kv_room_batch(room_bytes: float, shape: ModelShape, s: Strategy, workload: Workload, hw: HardwareProfile) -> int:
    """The most sequences a rollout replica can decode at once when `room_bytes` per device are left beside what its
    pool holds all iteration (every colocated model's weights, gradients and optimizer state): that room less the
    generation weights (`generation_weights_bytes`), over one sequence's KV cache (`kv_bytes_per_sequence`). What
    colocation costs the rollout: the more the pool holds, the fewer sequences per wave and the more decoding steps
    re-read the weights. 0: not one sequence fits."""
    free = room_bytes - generation_weights_bytes(shape, s, workload, hw)
    return max(0, int(free // kv_bytes_per_sequence(shape, s, workload, hw)))


def _generation(
    shape: ModelShape, s: Strategy, workload: Workload, hw: HardwareProfile, gpus_per_node: int
) -> tuple[float, float]:
    """Seconds and transient bytes per device of the rollout: reshard to the generation layout, then in each of
    d_g = devices / t_g replicas prefill and decode its sequences in waves of ``s.gen_batch`` (else the workload's
    ``gen_micro_batch``; the KV cache holds one wave); a decoding step reads the weight shard and the wave's KV
    cache, ``response_length`` steps per wave."""
    w = hw.dtype_bytes
    params = shape.params("lm")
    t_g = s.generation_tp
    replicas = s.rollout_replicas
    sequences = math.ceil(workload.sequences / replicas)  # sequences one replica generates
    wave = min(sequences, s.gen_batch or workload.gen_micro_batch)
    waves = math.ceil(sequences / wave)
    weights = matmul_params(shape, "lm") * w / t_g
    prompt = workload.mean_prompt  # the rollout prefills the prompts unpadded
    prefill_flops = forward_flops(shape, "lm", sequences * prompt, prompt) / t_g
    prefill = prefill_flops / (hw.flops * hw.infer_efficiency)
    prefill += sequences * prompt * shape.layers * hw.layer_token_overhead_s
    context = prompt + workload.response_length / 2  # tokens an average step attends to
    kv_read = wave * context * shape.kv_bytes_per_token(w) / t_g
    step_compute = 2 * matmul_params(shape, "lm") * wave / t_g / (hw.flops * hw.infer_efficiency)
    step_memory = (weights + kv_read) / (hw.memory_bandwidth * hw.decode_efficiency)
    step_comm = 2 * shape.layers * _all_reduce_s(wave * shape.hidden * w, t_g, False, hw)
    step = max(step_compute, step_memory) + step_comm + hw.decode_step_overhead_s
    step += wave * shape.layers * hw.layer_token_overhead_s
    decode = waves * workload.response_length * step
    if s.kind == "megatron":  # HybridFlow table 2: (t·p - t_g·p_g) / (t_g·p_g·t·p) x M inside micro-DP groups
        tp = s.tp * s.pp
        reshard = (tp - t_g) / (t_g * tp) * params * w / _bandwidth(tp, False, hw) if tp > t_g else 0.0
    elif s.kind == "fsdp":  # the rollout generates with whole weights, gathered from the shards
        reshard = _all_gather_s(params * w, s.dp, s.devices > gpus_per_node, hw)
    else:
        reshard = 0.0
    kv_cache = wave * kv_bytes_per_sequence(shape, s, workload, hw)
    weights_bytes = generation_weights_bytes(shape, s, workload, hw)
    return reshard + prefill + decode + hw.stage_overhead_s, weights_bytes + kv_cache
