"""Benchmark: raw decoding speed of vLLM vs Hugging Face ``generate`` on SmolLM2-135M, every sequence decoded to the
full length (``ignore_eos`` / ``min_new_tokens``), so neither engine gains from early stops: what the engines
themselves do per token on this machine. Random 60-token prompts; sampled at temperature 1; vLLM bf16 (as
``rollout.vllm_dtype``; ``--vllm-dtype float32`` on a CPU without bf16 instructions), HF fp32 weights (as the
actor's ``model.dtype: auto`` on CPU). Prints tokens/s per repetition (the first is warm-up) for each batch size.

    .venv/bin/python benchmarks/decode_throughput.py [--batch 32 128] [--tokens 64] [--repeats 3]
        [--vllm-dtype bfloat16|float32] [--vllm-only]
"""

import argparse
import os
import time

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_rates(path: str, batch: int, tokens: int, repeats: int, dtype: str = "bfloat16") -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=path,
        dtype=dtype,
        enforce_eager=True,
        seed=0,
        max_model_len=256,
        kv_cache_memory_bytes=2**30,
        enable_chunked_prefill=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(range(100 + i, 160 + i))) for i in range(batch)]
    rates = []
    for _ in range(repeats):
        params = [
            SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=i)
            for i in range(batch)
        ]
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - start))
    del llm
    return rates


def hf_rates(path: str, batch: int, tokens: int, repeats: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.stack([torch.arange(100 + i, 160 + i) for i in range(batch)])
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                top_k=0,
                top_p=1.0,
            )
        rates.append(batch * tokens / (time.perf_counter() - start))
    return rates


def steady(rates: list[float]) -> float:
    """Mean tokens/s after the first (warm-up) repetition."""
    return sum(rates[1:]) / max(1, len(rates) - 1)


def main() -> None:
    from hybridflow.engine.embedded_models import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--vllm-only", action="store_true", help="skip HF generate")
    args = parser.parse_args()
    path = str(resolve_model_path("smollm2"))
    print(f"{torch.get_num_threads()} torch threads; {args.tokens} new tokens per sequence; vLLM {args.vllm_dtype}")
    for batch in args.batch:
        engine = vllm_rates(path, batch, args.tokens, args.repeats, args.vllm_dtype)
        if args.vllm_only:
            print(f"batch {batch:>4}: vLLM {' '.join(f'{r:.0f}' for r in engine)} tok/s")
            continue
        hf = hf_rates(path, batch, args.tokens, args.repeats)
        print(
            f"batch {batch:>4}: vLLM {' '.join(f'{r:.0f}' for r in engine)} tok/s, "
            f"HF {' '.join(f'{r:.0f}' for r in hf)} tok/s; after warm-up {steady(engine) / steady(hf):.1f}x"
        )


if __name__ == "__main__":
    main()
