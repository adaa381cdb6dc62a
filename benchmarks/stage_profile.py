"""Benchmark: where each stage's seconds go, by kernel family, against the matmul peak.

Runs a config's iterations in one process (`SingleProcessTrainer`: the flow's iteration, every stage in this
process), the first ``--warmup`` unprofiled, then one under ``torch.profiler``, and prints per stage (``gen``,
``ref``, ``update_actor``, ``weight_sync``, ...) the self CPU seconds of each kernel family:

- ``matmul``: ``aten::mm / addmm / bmm / linear`` and vLLM's oneDNN / packed GEMMs, with the rate they reach on the
  stage's needed FLOPs (`needed_flops`, the blocks and the LM head; x3 for the update) against the measured peak;
- ``attention``: scaled-dot-product kernels (ours: `packed_sdpa`; vLLM's CPU attention);
- ``softmax``: log-softmax / softmax / entropy over the vocabulary;
- ``dtype casts``: ``aten::to / _to_copy / copy_`` (bf16 autocast's weight casts, fp32 master weights);
- ``elementwise``: the rest of aten's pointwise and reduction kernels (norms, SiLU, adds, masks);
- ``optimizer``: the fused AdamW step and gradient clipping;
- ``other``: Python and everything not in a kernel above (the stage's seconds minus its kernels').

    .venv/bin/python benchmarks/stage_profile.py [CONFIG] [--warmup 2] [-o key=value ...]
"""

import argparse
import contextlib
import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import hybridflow.engine.trainer as trainer_module
from hybridflow.engine.config import load_config
from hybridflow.engine.flops import matmul_flops
from hybridflow.engine.metrics import Timer
from hybridflow.engine.models import pick_dtype
from hybridflow.engine.shapes import model_shape
from hybridflow.engine.trainer import SingleProcessTrainer
from hybridflow.flows.placement.cost import needed_flops

FAMILIES = [
    ("optimizer", re.compile(r"adam|clip_grad|_foreach_norm|foreach")),
    ("matmul", re.compile(r"^aten::(mm|addmm|bmm|matmul|linear|_mm)$|onednn|gemm|weight_packed_linear|mkldnn")),
    ("attention", re.compile(r"scaled_dot_product|attention|flash|paged")),
    ("softmax", re.compile(r"softmax|logsumexp|entropy")),
    ("dtype casts", re.compile(r"^aten::(to|_to_copy|copy_|clone|contiguous)$")),
    ("elementwise", re.compile(r"^aten::")),
]
PASSES = {"gen": 1, "old_log_prob": 1, "ref": 1, "update_actor": 3}


class ProfiledTimer(Timer):
    """A `Timer` whose stages are also profiler ranges (``stage/<name>``), so kernels can be charged to stages."""

    @contextlib.contextmanager
    def __call__(self, name, pool=None):
        with record_function(f"stage/{name}"), super().__call__(name, pool):
            yield


def family(name: str) -> str | None:
    return next((fam for fam, pattern in FAMILIES if pattern.search(name)), None)


def stage_of(event) -> str | None:
    while event is not None:
        if event.name.startswith("stage/"):
            return event.name.removeprefix("stage/")
        event = event.cpu_parent
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="examples/grpo_smollm2.yaml")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=0, help="also list each stage's N kernels of most self time")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    overrides = ["trainer.logger=[]", "trainer.test_freq=0", "trainer.val_before_train=false", *args.override]
    cfg = load_config(args.config, overrides)
    trainer_module.Timer = ProfiledTimer  # stages become profiler ranges (this process only)
    trainer = SingleProcessTrainer(cfg)
    for _ in range(args.warmup):
        trainer.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        metrics = trainer.step()
        wall = time.perf_counter() - started
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        fam = family(event.name)
        stage = stage_of(event) if fam else None
        if stage is not None:
            seconds[stage][fam] += event.self_cpu_time_total / 1e6
            kernels[stage][event.name] += event.self_cpu_time_total / 1e6
    dtype = pick_dtype(cfg.model.dtype, torch.device("cpu"))
    peak = matmul_flops(cfg.trainer.num_threads or None, dtype=dtype)
    shape, n = model_shape(cfg.model.path), cfg.rollout.n
    prompt, response = metrics["prompt_length/mean"], metrics["response_length/mean"]
    forward = needed_flops(shape, [(prompt, [response] * n)] * cfg.data.train_batch_size, "lm")
    print(
        f"{args.config}: iteration {trainer.global_steps} profiled, {wall:.2f} s (with the profiler's overhead); "
        f"{cfg.data.train_batch_size * n} sequences of {prompt:.0f} + {response:.1f} tokens; "
        f"{str(dtype).removeprefix('torch.')} matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    names = [fam for fam, _ in FAMILIES] + ["other"]
    print(f"{'stage':>13} {'seconds':>8} " + " ".join(f"{name:>12}" for name in names) + "  matmul rate")
    for key, total in metrics.items():
        if not key.startswith("timing_s/") or key == "timing_s/step":
            continue
        stage = key.removeprefix("timing_s/")
        fams = seconds.get(stage, {})
        cells = [fams.get(name, 0.0) for name in names[:-1]]
        cells.append(max(total - sum(cells), 0.0))
        line = f"{stage:>13} {total:>8.2f} " + " ".join(f"{c:>12.3f}" for c in cells)
        if stage in PASSES and fams.get("matmul"):
            rate = PASSES[stage] * forward / fams["matmul"]
            line += f"  {rate / 1e9:.0f} GFLOP/s = {rate / peak:.0%} of peak"
        print(line)
    for stage, table in kernels.items():
        top = sorted(table.items(), key=lambda item: -item[1])[: args.top]
        if top:
            print(f"{stage}: " + ", ".join(f"{name} {s:.3f}" for name, s in top))


if __name__ == "__main__":
    main()
