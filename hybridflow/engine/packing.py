"""Packing a micro-batch for the forward passes: no padding, each prompt once for its samples.

The rollout lays a batch out as verl does: ``input_ids`` [B, P+T] = left-padded prompt (P tokens) followed by the
right-padded response (T tokens), a prompt's n samples in neighbouring rows. The log-prob, value and update passes
need neither the padding nor n copies of a prompt: `pack_rows` lays a micro-batch out as one sequence of its real
tokens, each prompt once followed by its samples' responses, with an attention mask that gives every token exactly
what it sees in its own padded row (HybridFlow issue 18: FLOP-lean iterations).

Attention over the packed sequence is block-diagonal by prompt group. `packed_sdpa`, registered with Hugging Face's
attention interface as ``PACKED_ATTENTION`` (the models `hybridflow.engine.models.load_model` loads use it), runs
attention on each group's block alone, so its cost grows with each group's length squared, not the micro-batch's:
on CPU in bf16, short groups all at once (`grouped_attention`: three batched products, as torch's flash backward
costs ~9x its forward on them), otherwise torch's scaled-dot-product attention group by group; without group spans
(generation, any other caller) it is Hugging Face's sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.engine.protocol import DataProto

PACKED_ATTENTION = "hybridflow_packed_sdpa"


def response_length(data: DataProto) -> int:
    """T, the padded response length: ``responses.shape[1]`` of a batch with ``responses`` int64 [B, T].

    Raises:
        KeyError: the batch has no ``responses``.
    """
    return int(data.batch["responses"].shape[1])


@dataclass
class PackedRows:
    """A micro-batch's rows as one sequence without padding, each prompt once for the samples that follow it.

    Layout: for each run of neighbouring rows with the same prompt (`prompt_groups`: the rollout's n samples), the
    prompt's real tokens, then each sample's real response tokens. The attention mask lets a prompt token see the
    earlier tokens of its prompt, and a response token see its prompt and the earlier tokens of its own response,
    which is exactly what each token sees in its padded row under causal attention; position ids are the rows' own.
    So every output equals the padded full-row forward's up to float32 rounding (the same products in other
    shapes), gradients reach a prompt from all its samples, and no position is padding. A row alone (n = 1, or
    ``share_prompts`` false) is its own group: packing without sharing.

    Attributes:
        input_ids, position_ids: int64 [1, L]; L = prompt tokens (once per group) + response tokens (real ones).
        attention_mask: bool [1, 1, L, L], True where a query (dim 2) may attend a key (dim 3); L^2 bytes (a
            micro-batch of 16k tokens: 256 MB), whatever the attention kernel then reads of it.
        predict: int64 [K], K = the micro-batch's trained response tokens (``response_mask``, else the response
            part of ``attention_mask``; row-major): the position of the packed sequence whose output predicts each
            (a prompt's last token predicts the first response token, response token t - 1 predicts token t). The
            tool and template tokens of an agent trajectory (``attention_mask`` 1, ``response_mask`` 0) are in the
            sequence as context, and no output is computed for them.
        rows, cols: int64 [K]: where each predicted token sits in the padded [b, T] layout.
        spans: [start, end) of each prompt group in the L positions (`packed_sdpa`).
        shape: (b, T).
        index: int64 [b, P+T]: the packed position of each real token of the padded rows (a shared prompt's tokens:
            the same position in each of its rows), -1 at padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    predict: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    spans: list[tuple[int, int]]
    shape: tuple[int, int]
    index: torch.Tensor

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [b, P+T, ...] of the padded rows at the L packed positions: [L, ...] (a shared prompt token's
        from the first of its rows)."""
        flat = self.index.flatten()
        real = torch.nonzero(flat >= 0).flatten()
        source = torch.empty(self.input_ids.shape[1], dtype=torch.long, device=flat.device)
        source[flat[real].flip(0)] = real.flip(0)  # written last to first: a shared position keeps its first row
        return values.flatten(0, 1)[source.to(values.device)]

    def spread(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """``values`` [L, ...] of the packed positions into the padded rows: [b, P+T, ...], a shared prompt's in each
        of its rows, `fill` at padding."""
        index = self.index.to(values.device)
        out = values[index.clamp(min=0)]
        out[index < 0] = fill
        return out

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [K, ...] into the padded layout: [b, T, ...] of their dtype, zero where no response token is
        (differentiable)."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


def pack_rows(micro: DataProto, share_prompts: bool = True) -> PackedRows:
    """Lay `micro` out as a `PackedRows` sequence: a repeated prompt once (`share_prompts`), no padding.

    Args:
        micro: ``input_ids``, ``attention_mask``, ``position_ids`` [b, P+T] (prompts left-padded, responses
            right-padded), ``responses`` [b, T], optionally ``response_mask`` [b, T]; a token is real where
            ``attention_mask`` is 1, and predicted where ``response_mask`` is (every real response token without
            one).
        share_prompts: False: every row keeps its own copy of its prompt.
    """
    batch = micro.batch
    t = response_length(micro)
    ids, mask, positions = batch["input_ids"], batch["attention_mask"].bool(), batch["position_ids"]
    p = ids.shape[1] - t
    trained_mask = (batch["response_mask"] if "response_mask" in batch else mask[:, p:]).bool()
    b = len(micro)
    counts = prompt_groups(micro).tolist() if share_prompts else [1] * b
    tokens, places, group_of, sample_of, predict, rows, cols = [], [], [], [], [], [], []
    length, row, spans = 0, 0, []
    index = torch.full(ids.shape, -1, dtype=torch.long)
    cpu_mask = mask.cpu()
    for group, count in enumerate(counts):
        start = length
        keep = mask[row, :p]
        tokens.append(ids[row, :p][keep])
        places.append(positions[row, :p][keep])
        size = len(tokens[-1])
        index[row : row + count, :p][:, cpu_mask[row, :p]] = torch.arange(length, length + size)
        group_of.append(torch.full((size,), group))
        sample_of.append(torch.full((size,), -1))
        length += size
        last_prompt = length - 1
        for r in range(row, row + count):
            keep = mask[r, p:]
            tokens.append(ids[r, p:][keep])
            places.append(positions[r, p:][keep])
            size = len(tokens[-1])
            index[r, p:][cpu_mask[r, p:]] = torch.arange(length, length + size)
            group_of.append(torch.full((size,), group))
            sample_of.append(torch.full((size,), r))
            previous = torch.arange(length - 1, length + size - 1)  # token k is predicted at position k - 1 ...
            previous[:1] = last_prompt  # ... and token 0 at the prompt's last
            trained = trained_mask[r][keep].cpu()  # tool tokens of an agent trajectory are context, not predicted
            predict.append(previous[trained])
            rows.append(torch.full((int(trained.sum()),), r))
            cols.append(torch.nonzero(keep).flatten().cpu()[trained])
            length += size
        row += count
        spans.append((start, length))
    group_of, sample_of = torch.cat(group_of), torch.cat(sample_of)
    order = torch.arange(length)
    visible = (
        (group_of[:, None] == group_of[None, :])
        & (order[None, :] <= order[:, None])
        & ((sample_of[None, :] == -1) | (sample_of[None, :] == sample_of[:, None]))
    )
    device = ids.device
    return PackedRows(
        input_ids=torch.cat(tokens).unsqueeze(0),
        position_ids=torch.cat(places).unsqueeze(0),
        attention_mask=visible[None, None].to(device),
        predict=torch.cat(predict).to(device),
        rows=torch.cat(rows).to(device),
        cols=torch.cat(cols).to(device),
        spans=spans,
        shape=(b, t),
        index=index.to(device),
    )


def prompt_groups(micro: DataProto) -> torch.Tensor:
    """Sizes of the runs of consecutive rows with the same prompt (ids and mask of the first P = L - T columns).

    Returns:
        int64 [groups], summing to the rows (all ones when no two neighbours share a prompt)."""
    t = response_length(micro)
    ids = micro.batch["input_ids"][:, :-t]
    mask = micro.batch["attention_mask"][:, :-t]
    same = (ids[1:] == ids[:-1]).all(-1) & (mask[1:] == mask[:-1]).all(-1)
    starts = torch.cat([torch.tensor([0], device=ids.device), torch.nonzero(~same).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([len(ids)], device=ids.device)])
    return (ends - starts).cpu()


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_spans: list[tuple[int, int]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's sdpa attention, run per prompt group of a packed sequence (`PackedRows.spans`).

    Exact: a query of one group may attend no key of another (the packed mask), so restricting each group's queries
    to its own keys drops only terms that are exactly zero.

    Args:
        query: float [1, heads, L, head_dim]; key, value: float [1, kv_heads, L, head_dim].
        attention_mask: bool [1, 1, L, L] (`PackedRows.attention_mask`), or whatever sdpa takes without spans.
        packed_spans: [start, end) of each group in the L positions; None: plain sdpa.

    Returns:
        (float [1, L, heads, head_dim], None), as Hugging Face's attention functions return.
    """
    if packed_spans is None or len(packed_spans) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    if _batch_groups(query, dtype, packed_spans, kwargs):  # q, k, v in the dtype autocast gives sdpa
        q, k, v = (x.to(dtype) for x in (query, key, value))
        return grouped_attention(q, k, v, attention_mask, packed_spans, kwargs.get("scaling")), None
    outputs = [
        sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            attention_mask[:, :, start:end, start:end],
            **kwargs,
        )[0]
        for start, end in packed_spans
    ]
    return torch.cat(outputs, dim=1), None


GROUPED_SCORES_BYTES = 32 * 2**20
"""Largest fp32 score tensor (groups x heads x longest group^2 x 4 bytes) `grouped_attention` materialises per layer:
above it (long responses) `packed_sdpa` runs the memory-lean flash kernel group by group instead."""


ATTENTION_OPTIONS = ("sliding_window", "softcap", "s_aux", "position_bias", "cache", "head_mask")
"""Attention keywords of Hugging Face models that `grouped_attention` does not implement: set, `packed_sdpa` runs
Hugging Face's sdpa group by group."""


def _batch_groups(query: torch.Tensor, dtype: torch.dtype, spans: list[tuple[int, int]], kwargs: dict) -> bool:
    """Whether `packed_sdpa` takes `grouped_attention` for attention computed in `dtype` (autocast's when it is on:
    a trained model's fp32 rotary embedding hands q and k over in fp32, and sdpa would cast them): on CPU in bf16 or
    fp16 (where torch's flash backward costs ~9x its forward on short groups: 8 groups of ~120 tokens, SmolLM2's
    heads, forward + backward 17.9 ms per layer group by group, 12.0 ms grouped; in float32 11.4 against 15.2, so
    float32 keeps the loop), no dropout or other attention options, and the scores within `GROUPED_SCORES_BYTES`."""
    longest = max(end - start for start, end in spans)
    plain = not kwargs.get("dropout") and all(kwargs.get(name) is None for name in ATTENTION_OPTIONS)
    scores = len(spans) * query.shape[1] * longest**2 * 4
    reduced = dtype in (torch.bfloat16, torch.float16)  # in float32 the flash loop measured faster
    return query.device.type == "cpu" and reduced and plain and scores <= GROUPED_SCORES_BYTES


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    spans: list[tuple[int, int]],
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of each prompt group over its own block, all groups in one batch of three products.

    Each group is padded to the longest group's length G by repeating its last position (a real token, so no query
    row is fully masked and nothing is NaN); padded keys are masked out and padded queries' outputs dropped, so
    they contribute exactly zero to every output and gradient. Scores and softmax in float32 (as torch's flash
    kernel keeps them), probabilities cast back to the values' dtype for the last product. Grouped KV heads are
    broadcast, not copied.

    Args:
        query: [1, heads, L, head_dim]; key, value: [1, kv_heads, L, head_dim]; any float dtype.
        attention_mask: bool [1, 1, L, L] (`PackedRows.attention_mask`).
        spans: [start, end) of each group, contiguous from 0 to L (`PackedRows.spans`).
        scaling: the scores' factor; None: head_dim ** -0.5.

    Returns:
        [1, L, heads, head_dim] in `value`'s dtype (Hugging Face's attention output layout).
    """
    with torch.autocast(query.device.type, enabled=False):  # float32 scores whatever the autocast dtype
        return _grouped_attention(query, key, value, attention_mask, spans, scaling)


def _grouped_attention(query, key, value, attention_mask, spans, scaling):
    heads, length, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    device = query.device
    starts = torch.tensor([start for start, _ in spans], device=device)
    sizes = torch.tensor([end - start for start, end in spans], device=device)
    longest = int(sizes.max())
    offsets = torch.arange(longest, device=device)
    real = offsets[None, :] < sizes[:, None]  # [groups, G]
    index = starts[:, None] + torch.minimum(offsets[None, :], sizes[:, None] - 1)  # padding -> the group's last token
    flat = index.reshape(-1)
    groups = len(spans)

    def gather(x: torch.Tensor, n_heads: int) -> torch.Tensor:  # [1, n, L, d] -> [groups, n, G, d]
        return x[0][:, flat].reshape(n_heads, groups, longest, dim).transpose(0, 1)

    q = gather(query, heads).reshape(groups, kv_heads, heads // kv_heads, longest, dim)
    k, v = gather(key, kv_heads).unsqueeze(2), gather(value, kv_heads).unsqueeze(2)
    visible = attention_mask[0, 0][index[:, :, None], index[:, None, :]] & real[:, None, :]  # [groups, G, G]
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [groups, kv, r, G, d]
    out = out.reshape(groups, heads, longest, dim).transpose(1, 2).reshape(groups * longest, heads, dim)
    return out[real.reshape(-1)].reshape(1, length, heads, dim)


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # generation builds its masks as for sdpa
