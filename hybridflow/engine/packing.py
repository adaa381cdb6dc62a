"""Packing a micro-batch for the forward passes: no padding, each prompt once for its samples.

The rollout lays a batch out as verl does: ``input_ids`` [B, P+T] = left-padded prompt (P tokens) followed by the
right-padded response (T tokens), a prompt's n samples in neighbouring rows. The log-prob, value and update passes
need neither the padding nor n copies of a prompt: `pack_rows` lays a micro-batch out as one sequence of its real
tokens, each prompt once followed by its samples' responses, with an attention mask that gives every token exactly
what it sees in its own padded row (HybridFlow issue 18: FLOP-lean iterations).

Attention over the packed sequence is block-diagonal by prompt group. `packed_sdpa`, registered with Hugging Face's
attention interface as ``PACKED_ATTENTION`` (the models `hybridflow.engine.models.load_model` loads use it), runs
torch's scaled-dot-product attention on each group's block alone, so its cost grows with each group's length
squared, not the micro-batch's; without group spans (generation, any other caller) it is Hugging Face's sdpa.
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
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    predict: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    spans: list[tuple[int, int]]
    shape: tuple[int, int]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [K] into the padded layout: float [b, T], zero where no response token is (differentiable)."""
        out = values.new_zeros(self.shape)
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
    for group, count in enumerate(counts):
        start = length
        keep = mask[row, :p]
        tokens.append(ids[row, :p][keep])
        places.append(positions[row, :p][keep])
        size = len(tokens[-1])
        group_of.append(torch.full((size,), group))
        sample_of.append(torch.full((size,), -1))
        length += size
        last_prompt = length - 1
        for r in range(row, row + count):
            keep = mask[r, p:]
            tokens.append(ids[r, p:][keep])
            places.append(positions[r, p:][keep])
            size = len(tokens[-1])
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


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # generation builds its masks as for sdpa
