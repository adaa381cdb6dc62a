"""vLLM's engine modules, imported when this module is: what a fork server whose ranks may build vLLM engines
preloads (`hybridflow.slurm.forked.warm_up` with ``vllm=True``).

``import vllm`` imports little; the first ``vllm.LLM(...)`` of a process imports ~2,500 more modules (its entry
points, engine core, CPU worker and model runner, the Llama model, the sampler, and openai, scipy, opencv, fastapi
and grpc along the way): the tiny model's first engine took 5.2 s to build in a fresh process here, a second one in
the same process 1.5 s. Imported once in the fork server, each rank forked from it builds its first engine in the
time of the second.

Nothing is raised: without vLLM, or with one that fails to import, the fork server serves as it would without this
module, and a rank that builds an engine reports the error itself. Not on a machine with NVIDIA devices: vLLM's
CUDA platform is set up in the rank that uses it, never in a process ranks are forked from.
"""

from __future__ import annotations

import contextlib
import glob
import importlib

ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.sample.sampler",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.layers.quantization.compressed_tensors.utils",
)
"""The modules whose imports pull in what a CPU engine of a Llama-architecture model imports while it is built."""


def preload() -> None:
    """Import `ENGINE_MODULES` (CPU machines only); stops at the first that fails. Never raises."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return
    from hybridflow.engine.rollout.vllm import import_vllm

    with contextlib.suppress(Exception):
        import_vllm()
        for name in ENGINE_MODULES:
            importlib.import_module(name)


preload()
