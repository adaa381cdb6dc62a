"""Model dimensions for the cost model: read from a Hugging Face config, or a named preset (the paper's Llama sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's dimensions (a Llama-style block: attention with grouped KV heads, gated MLP).

    A mixture-of-experts block (`hybridflow.engine.moe`) has `experts` > 1 gated MLPs of width `intermediate`, a
    router of ``hidden x experts`` weights, each token through `top_k` of them and through `shared_intermediate`
    columns of shared expert (Qwen2-MoE's, with its one-output gate). Its memory holds every expert
    (`layer_params`); a token's FLOPs meet only its top-k (`active_layer_params`, as megatron-core's and verl's MoE
    MFU count them).

    `attention_head_dim` is the config's ``head_dim`` (0: hidden / heads); `qk_norm` adds Qwen3's per-head query and
    key RMSNorm weights, `qkv_bias` Qwen2's q, k and v biases.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False
    experts: int = 1
    top_k: int = 1
    shared_intermediate: int = 0
    attention_head_dim: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        """The config's ``head_dim`` where it sets one (Qwen3: 128 at hidden 2048 / 32 heads), else hidden / heads."""
        return self.attention_head_dim or self.hidden // self.heads

    def _block(self, mlps: int) -> int:
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        attention += 2 * self.head_dim if self.qk_norm else 0  # Qwen3's per-head query and key RMSNorm weights
        attention += (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0  # Qwen2's
        mlp = 3 * self.hidden * self.intermediate * mlps
        if self.experts > 1:  # the router, and the shared expert with its gate
            mlp += self.hidden * self.experts + 3 * self.hidden * self.shared_intermediate
            mlp += self.hidden if self.shared_intermediate else 0
        return attention + mlp + 2 * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one block: q and o projections, k and v (grouped), the gated MLP (every expert, the router
        and the shared expert of an MoE block), two norms."""
        return self._block(self.experts)

    @property
    def active_layer_params(self) -> int:
        """The weights of one block a token's forward multiplies with: `layer_params` with only `top_k` experts."""
        return self._block(self.top_k if self.experts > 1 else 1)

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters over all blocks (0 for a dense model): what expert parallelism splits."""
        return self.layers * 3 * self.hidden * self.intermediate * self.experts if self.experts > 1 else 0

    def lora_params(self, rank: int) -> int:
        """Parameters of a rank-`rank` LoRA adapter on every linear layer of the blocks (PEFT's ``all-linear``):
        ``r x (in + out)`` per projection (A: r x in, B: out x r; Hu et al. 2021, section 4.1)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * (self.hidden + q_out) + 2 * (self.hidden + kv_out) + 3 * (self.hidden + self.intermediate)
        return rank * per_layer * self.layers

    def params(self, head: str = "lm") -> int:
        """Parameter count with a language-model head (``lm``: actor, ref) or a scalar head (``value``: critic,
        reward model)."""
        embedding = self.vocab * self.hidden
        untied = 0 if self.tied_embeddings else self.vocab * self.hidden
        out = untied if head == "lm" else self.hidden
        return embedding + self.layers * self.layer_params + self.hidden + out

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies across all layers (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# Llama 2 7B / 13B / 70B (Touvron et al. 2023, table 1 and the released configs) and Code Llama 34B: the model sizes of
# the HybridFlow paper's evaluation (section 8.1).
PRESETS: dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
    "llama-13b": ModelShape(
        "llama-13b", layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32000
    ),
    "llama-34b": ModelShape("llama-34b", layers=48, hidden=8192, intermediate=22016, heads=64, kv_heads=8, vocab=32000),
    "llama-70b": ModelShape("llama-70b", layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=32000),
}


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of a preset (``llama-7b`` ...), an embedded model (``tiny``, ``smollm2``) or a local Hugging Face
    folder (its config.json).

    Raises:
        FileNotFoundError: the folder does not exist (or an embedded model is not prepared), naming the fix.
        ValueError: its config lacks a transformer dimension the cost model needs, or is an MoE architecture that
            does not run here (`hybridflow.engine.moe.moe_spec`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    from transformers import AutoConfig

    from hybridflow.engine.embedded_models import resolve_model_path
    from hybridflow.engine.moe import moe_spec

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    spec = moe_spec(config)
    try:
        heads = config.num_attention_heads
        width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        moe = {}
        if spec is not None:  # experts of moe_intermediate_size where the config has one (Qwen), else intermediate
            width = getattr(config, "moe_intermediate_size", None) or width
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            moe = {"experts": spec.num_experts, "top_k": spec.top_k, "shared_intermediate": shared}
        return ModelShape(
            name=Path(name_or_path).name,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=width,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_head_dim=getattr(config, "head_dim", None) or 0,
            qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=bool(getattr(config, "qkv_bias", None) or getattr(config, "attention_bias", False)),
            **moe,
        )
    except AttributeError as e:
        raise ValueError(f"{path}/config.json: the planner needs a decoder's dimensions, missing {e.name!r}") from None


def run_models(cfg, preset: str | None = None) -> dict[str, ModelShape]:
    """The models of a run config (`HybridFlowConfig`) the planner places: the actor (with its rollout) and ref
    from ``model.path``, the critic from ``critic.model_path`` (else ``model.path``), the reward model from
    ``reward_model.path`` (or, with only Safe-RLHF's cost model, ``reward_model.cost_path``: `Workload.scorers`
    counts both), the distillation teacher from ``teacher.model_path`` (with ``teacher.routes`` the largest: each
    row meets one teacher, so its forward is priced as the largest's over all rows); only those the run uses.
    `preset` replaces every model's shape (e.g. ``llama-7b``).

    Raises:
        KeyError: `preset` is not a preset name (the message lists them)."""
    if preset is not None and preset not in PRESETS:
        raise KeyError(f"no model preset {preset!r}; presets: {', '.join(PRESETS)}")
    roles = cfg.roles()
    paths = {"actor": cfg.model.path, "ref": cfg.model.path, "critic": cfg.critic.model_path or cfg.model.path}
    rm = cfg.reward_model
    paths["reward_model"] = rm.path if rm.enable else rm.cost_path
    teachers = [preset or path for path in cfg.teacher.model_paths().values()]
    paths["teacher"] = max(teachers, key=lambda path: model_shape(path).params()) if teachers else None
    wanted = ["actor"] + [m for m in ("critic", "ref", "reward_model", "teacher") if m in roles]
    shapes: dict[str, ModelShape] = {}
    for model in wanted:
        source = preset or paths[model]
        if source not in shapes:
            shapes[source] = model_shape(source)
    return {model: shapes[preset or paths[model]] for model in wanted}
