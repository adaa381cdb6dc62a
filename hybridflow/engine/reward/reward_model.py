"""The reward model: a sequence-classification model that scores each (prompt, response) with one number.

The RM may have a tokenizer of its own (another vocabulary, another chat template): the response is decoded with the
actor's tokenizer, appended to the prompt's chat messages (``raw_prompt``) as the assistant's turn, rendered with the
RM's chat template and re-tokenized with the RM's tokenizer. A text longer than ``max_length`` tokens loses tokens
from the left (the start of the prompt), so the response is always scored whole. The score is the RM's output at the
last real token (by the attention mask, not by searching for pad ids, which may also occur inside the text) and is
placed on the last response token, as verl does (``rm_scores`` [B, T]).

`RewardModel` is the ``reward_model`` role a worker hosts (``reward_model`` config section, stage ``rm_score``);
`check_reward_model` is the pre-flight check of the same folder without loading its weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.engine.extensions import training_backend
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import last_positions

if TYPE_CHECKING:
    from hybridflow.engine.config import RewardModelConfig


class RewardModelError(ValueError):
    """The reward model at ``reward_model.path`` cannot score: not a sequence classifier, not one label, no pad or
    EOS token. The message names the key and the fix."""


def check_reward_model(path: str | Path, key: str = "reward_model.path") -> tuple[Any, Any]:
    """Check a reward model folder (`key` names its setting: ``reward_model.path`` or Safe-RLHF's
    ``reward_model.cost_path``) without loading its weights: ``(config, tokenizer)``, the tokenizer's pad token set
    (EOS when it has none).

    Raises:
        RewardModelError: the folder's model is not a ``*ForSequenceClassification`` with one label, or its tokenizer
            has neither a pad token nor an EOS token to pad with.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(
            f"{key}={path}: its config.json names {architectures or 'no architecture'}, not a "
            "*ForSequenceClassification model; give a reward model trained with one output (hf rm train, or "
            "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1) then save_pretrained), or, for a "
            "causal LM that judges each response (a generative reward model), set reward_model.judge.enable=true "
            "with reward_model.judge.prompt_function and verdict_function"
        )
    if config.num_labels != 1:
        raise RewardModelError(
            f"{key}={path}: the model has {config.num_labels} labels; a reward model has exactly one "
            "(num_labels=1: one scalar score per sequence)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise RewardModelError(
                f"{key}={path}: its tokenizer has no pad token and no EOS token to pad with; set "
                "pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return config, tokenizer


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load a reward model folder: ``(model, tokenizer)``, the model in eval mode with its pad id set.

    Args:
        path: a local Hugging Face folder of a decoder ``*ForSequenceClassification`` model with one label.
        dtype: the weights' dtype.

    Raises:
        RewardModelError: as `check_reward_model`, or the model has no ``score`` head over a decoder.
    """
    from transformers import AutoModelForSequenceClassification

    _, tokenizer = check_reward_model(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if not hasattr(model, "score"):
        raise RewardModelError(
            f"reward_model.path={path}: {type(model).__name__} has no 'score' head over a decoder's hidden states; "
            "use a decoder-only reward model (Llama, Qwen, Mistral, ... *ForSequenceClassification)"
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval().requires_grad_(False), tokenizer


def render_chat(messages: Sequence[dict[str, str]], tokenizer: Any) -> str:
    """Chat messages as the reward model reads them: its tokenizer's chat template, or without one the messages'
    contents, one per line. One rendering for scoring, training pairs and the pre-flight length check."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(list(messages), tokenize=False)
    return "\n".join(m["content"] for m in messages)


def rendered_prompt_length(messages: list[dict[str, str]], rm_tokenizer: Any) -> int:
    """Tokens of a prompt's chat messages in the RM's template, before any response (for the pre-flight check that
    ``reward_model.max_length`` leaves room for the prompt)."""
    return len(rm_tokenizer(render_chat(messages, rm_tokenizer), add_special_tokens=False)["input_ids"])


def reward_model_texts(data: DataProto, actor_tokenizer: Any, rm_tokenizer: Any) -> list[str]:
    """The text the RM reads for each row: ``raw_prompt`` (chat messages) plus the decoded response as the
    assistant's turn, rendered with the RM's chat template (without one: the messages' contents, one per line).

    Args:
        data: ``responses`` int64 [B, T], ``response_mask`` [B, T], non-tensor ``raw_prompt`` (B chat lists).
    """
    responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
    texts = []
    for i, messages in enumerate(data.non_tensor_batch["raw_prompt"]):
        response = actor_tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True)
        texts.append(render_chat([*messages, {"role": "assistant", "content": response}], rm_tokenizer))
    return texts


def encode_texts(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize `texts` for a reward model: ``(input_ids, attention_mask)`` int64 [N, W], right-padded, each text
    keeping its last `max_length` tokens (no special tokens added: a chat template has them)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][-max_length:] for t in texts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.int64)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)] = torch.as_tensor(x, dtype=torch.int64)
        attention_mask[row, : len(x)] = 1
    return input_ids, attention_mask


def last_token_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's output at each row's last real token: [N] in the model's dtype (differentiable).

    Args:
        model: a ``*ForSequenceClassification`` (``base_model`` and a ``score`` head) with one label.
        input_ids, attention_mask: int64 [N, W], right-padded (`encode_texts`).
    """
    device = next(model.parameters()).device
    attention_mask = attention_mask.to(device)
    hidden = model.base_model(input_ids=input_ids.to(device), attention_mask=attention_mask)[0]
    per_token = model.score(hidden)[..., 0]  # [N, W]
    last = attention_mask.sum(-1) - 1
    return per_token[torch.arange(len(input_ids), device=device), last]


@torch.no_grad()
def score_texts(
    model: Any, tokenizer: Any, texts: Sequence[str], max_length: int, micro_batch_size: int
) -> torch.Tensor:
    """The RM's score of each text: float32 [N], its output at the text's last token (`encode_texts`,
    `last_token_scores`), in micro-batches of `micro_batch_size` texts."""
    scores = []
    for start in range(0, len(texts), micro_batch_size):
        input_ids, attention_mask = encode_texts(tokenizer, texts[start : start + micro_batch_size], max_length)
        scores.append(last_token_scores(model, input_ids, attention_mask).float().cpu())
    return torch.cat(scores) if scores else torch.zeros(0)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """float32 [B, T]: each row's score on its last response token (position 0 for an empty response), 0 elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(scores)), last_positions(response_mask.cpu())] = scores.float()
    return out


class RewardModel:
    """The ``reward_model`` role of a worker rank: a frozen sequence classifier scoring rollout batches.

    With ``reward_model.strategy: fsdp`` on several ranks its weights are sharded over the group (FSDP2, 1/D of the
    weights per rank at rest, the memory that matters when it is colocated with the trained models) and gathered
    for the duration of one scoring call; with ``ddp`` every rank holds the whole model.

    Args:
        config: the ``reward_model`` section.
        path: its folder, resolved (`hybridflow.engine.embedded_models.resolve_model_path`).
        actor_tokenizer: decodes the rollout's responses.
        device: where it runs; dtype: its weights' dtype (``reward_model.dtype`` resolved by ``pick_dtype``).
        column: the batch column its scores go to: ``rm_scores``; Safe-RLHF's cost model (``reward_model.cost_path``,
            the same section's tokenization, micro-batches, strategy and dtype): ``token_level_costs``.

    Raises:
        RewardModelError: see `load_reward_model`.
    """

    def __init__(
        self,
        config: RewardModelConfig,
        path: Path,
        actor_tokenizer: Any,
        device,
        dtype: torch.dtype,
        column: str = "rm_scores",
    ):
        import torch.distributed as dist

        self.config, self.column = config, column
        self.model, self.tokenizer = load_reward_model(path, dtype)
        self.model.to(device)
        self.actor_tokenizer = actor_tokenizer
        sharded = training_backend(config.strategy, "reward_model.strategy").sharded
        if sharded and dist.is_initialized() and dist.get_world_size() > 1:
            from hybridflow.engine.backends.fsdp import shard_model

            shard_model(self.model)

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (the `column`) float32 [B, T]: each row's RM score on its last response token, 0 elsewhere.

        Args:
            data: ``responses`` int64 [B, T], ``response_mask`` [B, T], non-tensor ``raw_prompt`` (chat lists).
        """
        from hybridflow.engine.backends.fsdp import gathered

        texts = reward_model_texts(data, self.actor_tokenizer, self.tokenizer)
        with gathered(self.model):  # fsdp: every rank gathers once (a collective), whatever its row count
            scores = score_texts(
                self.model, self.tokenizer, texts, self.config.max_length, self.config.micro_batch_size
            )
        return DataProto.from_dict({self.column: place_on_last_token(scores, data.batch["response_mask"])})
