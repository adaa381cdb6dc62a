"""Benchmark helper: the vLLM engine alone against our rollout around it, on a run's first training batches.

Builds the config's training prompts and sampler exactly as the flow does (`build_prompt_rows`, `train_sampler`:
same prompts, same order), starts one `VLLMRollout` (the engine options of a run), and for each of the first
``--iterations`` batches generates the ``rollout.n`` samples twice, alternating which goes first:

- ``engine``: the engine alone: ``llm.generate`` on the token ids, each sequence with the sampling parameters and
  seed the rollout gives it, nothing else (the physical limit our rollout can reach here);
- ``rollout``: `VLLMRollout.generate_sequences` on the collated batch: the same call plus what sits around it
  (requests and sampling parameters built, outputs copied into the DataProto's tensors).

Both serve the same (untrained) weights and draw the same samples, so they generate the same tokens. Prints one
JSON object: per batch and per side, seconds and response tokens.

    .venv/bin/python benchmarks/vllm_standalone.py CONFIG [--iterations 4] [-o key=value ...]
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.engine.config import load_config
from hybridflow.engine.data import PromptDataset, build_prompt_rows, train_sampler
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.rollout.hf import sampling_seed
from hybridflow.engine.rollout.vllm import VLLMRollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(args.config, args.override)
    torch.set_num_threads(cfg.trainer.num_threads or torch.get_num_threads())
    path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_rows, _ = build_prompt_rows(cfg.data)
    sampler = train_sampler(PromptDataset(train_rows, tokenizer, cfg.data.max_prompt_length), cfg)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rollout = VLLMRollout(model, tokenizer, str(path), cfg.rollout, cfg.data.max_prompt_length, cfg.trainer.seed)
    vllm, n = rollout._vllm, cfg.rollout.n
    batches = []
    for step in range(1, args.iterations + 1):
        prompts = sampler.next_batch()
        prompts.meta_info["global_steps"] = step
        rows = zip(prompts.batch["input_ids"], prompts.batch["attention_mask"], strict=True)
        ids = [row[mask.bool()].tolist() for row, mask in rows]
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(n)]
        seeds = [sampling_seed(cfg.trainer.seed, step, "train", i) for i in range(len(requests))]
        temperature, length = cfg.rollout.temperature, cfg.rollout.response_length
        figures = {}
        for side in ("engine", "rollout") if step % 2 else ("rollout", "engine"):
            started = time.perf_counter()
            if side == "engine":
                params = [rollout._sampling_params(temperature, length, s) for s in seeds]
                outputs = rollout.llm.generate(requests, params, use_tqdm=False)
                tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
            else:
                out = rollout.generate_sequences(prompts)
                tokens = int(out.batch["response_mask"].sum())
            figures[side] = {"seconds": time.perf_counter() - started, "tokens": tokens}
        batches.append(figures)
    print(json.dumps({"sequences": len(requests), "batches": batches}))


if __name__ == "__main__":
    main()
