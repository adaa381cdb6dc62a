"""Benchmark (simulated): streaming and partial rollouts at 32-128 GPUs on long responses, against the async mode's
batch generation and the colocated synchronous loop.

No cluster is needed. The training side's seconds come from the planner's cost model
(`hybridflow.flows.placement.cost.estimate`: a 7B actor and its ref, ``llama-7b`` shape, bf16, FSDP, H100s, as
`benchmarks/async_simulation.py`); the generation side is a decode simulation of one vLLM engine per GPU (tp 1: the
7B model's 13 GB fit beside a KV cache of the rest of the usable memory), every engine serving its even share of
each batch's prompts (``--prompts`` / GPUs of the rollout), whole groups of ``--n`` samples:

- a decode step costs the bytes it reads at the decode share of the memory bandwidth (the weights once and every
  running sequence's keys and values: ``(W + kv_bytes x context tokens) / (bandwidth x decode_efficiency)``), plus
  the profile's fixed seconds per step; starting a sample prefills its context at the forward pass's FLOP/s;
- a sample starts while the KV cache holds every running sample's context; when a step would overflow it, the
  newest running sample is preempted and recomputed later (vLLM's recompute preemption);
- response lengths are log-normal (median ``--max-response`` / 4, sigma ``--sigma``) capped at ``--max-response``:
  the long tail that leaves a batch's last sequences decoding alone.

Modes (the same admission count, ``rollout.max_staleness`` k, a push every update):

- ``sync``: colocated, every GPU generates the batch, then trains on it (no push: the 3D-HybridEngine reshards in
  place);
- ``batch``: ``trainer.mode: async`` with streaming off, the rollout on G GPUs and training on the rest: the
  rollout's pool serves one batch's generation call at a time, pushes queued behind the calls admitted;
- ``stream``: ``rollout.streaming`` with partial rollouts: every admitted sample shares the engine, batches handed
  over by `hybridflow.engine.rollout.admission.StreamAdmission` (the run's own admission control), and a push
  interrupts the samples in flight, loads, and re-prefills them under the new weights;
- ``stream-drain``: streaming without partial rollouts: at a push the engine starts no sample until those in flight
  have finished, then loads.

Prints, per cluster size and longest response, the best split of each mode (G, multiples of 8), its seconds per
iteration (mean after the first ``--warmup``), speedup over ``sync`` and the rollout engines' KV cache use (the
share of the cache's tokens held, averaged over the run: a batch's tail decoding alone, a load or an idle engine
hold little); then the published figures of verl's fully-async trainer and AReaL (their own models, workloads and
hardware).

    .venv/bin/python benchmarks/streaming_simulation.py [--gpus 32 64 128] [--max-response 8192 16384 28672]
        [--prompts 128] [--n 16] [--staleness 1] [--iterations 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field

from async_simulation import GPUS_PER_NODE, stage_seconds

from hybridflow.engine.rollout.admission import StreamAdmission
from hybridflow.engine.shapes import PRESETS
from hybridflow.flows.placement.cost import Workload
from hybridflow.flows.placement.hardware import hardware_profile

PROMPT = 512
PUBLISHED = [
    ("verl fully-async (Qwen2.5-7B, 64 rollout + 64 train GPUs vs 128 colocated)", "2.35-2.67x"),
    ("AReaL (boba math, 1.5B, async vs its sync mode)", "2.77x"),
]


@dataclass
class Engine:
    """One GPU's decode engine: its cost constants and its samples (running: context tokens and tokens left)."""

    weight_bytes: float
    kv_per_token: float
    kv_capacity: float  # tokens
    read_rate: float  # bytes/s
    step_overhead: float
    prefill_rate: float  # tokens/s
    now: float = 0.0
    running: list[list] = field(default_factory=list)  # [group, context tokens, tokens left]
    waiting: list[list] = field(default_factory=list)
    kv_seconds: float = 0.0  # the KV cache's tokens held, integrated over decode time (token-seconds)

    def start_waiting(self, allowed) -> None:
        """Start waiting samples (oldest first) while the cache holds them and `allowed(sample)`."""
        context = sum(s[1] for s in self.running)
        while self.waiting and allowed(self.waiting[0]) and context + self.waiting[0][1] + 1 <= self.kv_capacity:
            sample = self.waiting.pop(0)
            self.running.append(sample)
            context += sample[1]
            self.now += sample[1] / self.prefill_rate

    def advance(self, until: float) -> list[int]:
        """Decode until the next sample finishes, the cache would overflow, or `until` (seconds); returns the groups
        of the samples that finished. Between those events every step costs ``a + b x context``, with the context
        growing by one token per running sample per step: the steps are summed in closed form."""
        count, context = len(self.running), sum(s[1] for s in self.running)
        a = (self.weight_bytes / self.read_rate) + self.step_overhead
        b = self.kv_per_token / self.read_rate
        steps = min(s[2] for s in self.running)
        steps = min(steps, max(1, int((self.kv_capacity - context) // count)))

        def cost(m: int) -> float:  # m steps: sum over j < m of a + b (context + count j)
            return m * a + b * (m * context + count * m * (m - 1) / 2)

        if self.now + cost(steps) > until:  # stop at `until`: the most steps that fit (at least one)
            lo, hi = 1, steps
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.now + cost(mid) <= until else (lo, mid - 1)
            steps = lo
        self.now += cost(steps)
        self.kv_seconds += cost(steps) * (context + count * steps / 2)
        done = []
        for s in self.running:
            s[1] += steps
            s[2] -= steps
        for s in [s for s in self.running if s[2] <= 0]:
            self.running.remove(s)
            done.append(s[0])
        context = sum(s[1] for s in self.running)
        while context > self.kv_capacity and len(self.running) > 1:  # recompute preemption of the newest
            victim = self.running.pop()
            context -= victim[1]
            self.waiting.insert(0, victim)
        return done


def engine_for(hw, shape) -> Engine:
    """A tp-1 engine of `shape` in bf16 on one device of `hw`."""
    weight_bytes = shape.params("lm") * 2
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    capacity = (hw.memory_bytes * hw.usable_memory - weight_bytes) / kv_per_token
    read_rate = hw.memory_bandwidth * hw.decode_efficiency
    prefill = hw.flops * hw.infer_efficiency / (2 * shape.params("lm"))
    return Engine(weight_bytes, kv_per_token, capacity, read_rate, hw.decode_step_overhead_s, prefill)


def train_and_push(devices: int, prompts: int, n: int, mean_response: float, longest: int) -> tuple[float, float]:
    """The seconds of one batch's training (old_log_prob, update, ref) on `devices` and of one weight push, as
    `async_simulation.stage_seconds` has the cost model give them."""
    work = Workload(
        sequences=prompts * n,
        prompt_length=PROMPT,
        response_length=longest,
        actor_steps=4,
        critic_steps=0,
        samples=n,
        response_mean=mean_response,
    )
    stages = stage_seconds(devices, devices, work)
    return stages.train, stages.push


def lengths(groups: int, n: int, longest: int, sigma: float, rng: random.Random) -> list[list[int]]:
    """Each group's `n` response lengths: log-normal, median `longest` / 4, capped at `longest`."""
    mu = math.log(longest / 4)
    return [[min(longest, max(16, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)] for _ in range(groups)]


def simulate(mode: str, gpus: int, gen_gpus: int, args, longest: int) -> tuple[float, float]:
    """Seconds per iteration after the warm-up and the engines' KV cache use (the share of its tokens held, over
    the whole run: idle time and a batch's tail alone hold little), for one engine's share of the batches (engines
    are alike: each serves prompts / gen_gpus groups of every batch)."""
    hw, shape = hardware_profile("h100-80gb"), PRESETS["llama-7b"]
    rng = random.Random(args.seed)
    per_engine = max(1, args.prompts // gen_gpus)
    work = [lengths(per_engine, args.n, longest, args.sigma, rng) for _ in range(args.iterations)]
    mean_response = sum(sum(map(sum, w)) for w in work) / (args.iterations * per_engine * args.n)
    train_devices = gpus if mode == "sync" else gpus - gen_gpus
    train_s, push_s = train_and_push(train_devices, args.prompts, args.n, mean_response, longest)
    engine = engine_for(hw, shape)
    k = args.staleness if mode != "sync" else 0
    admission = StreamAdmission(per_engine, k, args.iterations * per_engine)
    left: dict[str, int] = {}  # group -> samples unfinished
    group_of_batch: dict[str, int] = {}  # group -> the batch whose prompts it came from
    version = admitted_batches = 0
    ends: list[float] = []  # when each iteration's training (and publish) ends
    pushes: list[float] = []  # published versions the engines have not loaded yet: when each was published
    taken: list[list[str]] = []  # batches handed over, not trained yet
    trainer_free = 0.0

    def admit() -> None:
        nonlocal admitted_batches
        while admitted_batches < args.iterations and admission.room(version) >= per_engine:
            t = admitted_batches
            uids = [f"{t}-{g}" for g in range(per_engine)]
            admission.admit(uids, version)
            for g, uid in enumerate(uids):
                left[uid] = args.n
                group_of_batch[uid] = t
                engine.waiting += [[uid, PROMPT, length] for length in work[t][g]]
            admitted_batches += 1

    def push_due() -> bool:
        return bool(pushes) and engine.now >= pushes[0]

    def allowed(sample) -> bool:
        if mode in ("batch", "sync"):  # one generation call at a time: the oldest admitted batch's samples only
            running = {group_of_batch[s[0]] for s in engine.running}
            return group_of_batch[sample[0]] <= min(running, default=math.inf)
        return not (mode == "stream-drain" and push_due())  # draining: nothing starts before the load

    admit()
    while len(ends) < args.iterations:
        engine.start_waiting(allowed)
        # a push loads once it may: at once with partial rollouts (the samples in flight interrupted, recomputed
        # after the load), after the samples in flight without, after every generation call admitted before it in
        # batch mode (queued behind them)
        blocked = (mode == "stream-drain" and engine.running) or (
            mode == "batch" and (engine.running or engine.waiting)
        )
        if push_due() and not blocked:
            if mode == "stream":
                engine.waiting, engine.running = engine.running + engine.waiting, []
            engine.now += push_s
            pushes.pop(0)
            version += 1
            admit()
            continue
        if taken and engine.now >= trainer_free:  # the trainer takes the next batch
            taken.pop(0)
            if mode == "sync":  # colocated: the same devices train, then generate the next batch
                engine.now += train_s
                ends.append(engine.now)
                version += 1
                admit()
                continue
            trainer_free = engine.now + train_s + push_s
            ends.append(trainer_free)
            pushes.append(trainer_free)
            continue
        upcoming = [
            t for t in (trainer_free if taken else math.inf, pushes[0] if pushes else math.inf) if t > engine.now
        ]
        until = min(upcoming, default=math.inf)
        if not engine.running:
            if until == math.inf:
                raise RuntimeError(f"{mode}: the simulation stalled at {engine.now:.1f} s")
            engine.now = until  # idle until the trainer or a push
            continue
        for uid in engine.advance(until):
            left[uid] -= 1
            if left[uid] == 0:
                admission.finish([uid])
        while (batch := admission.next_batch()) is not None:
            taken.append(batch)
    steady = ends[args.warmup :]
    per_iteration = (steady[-1] - steady[0]) / (len(steady) - 1)
    return per_iteration, engine.kv_seconds / (engine.kv_capacity * engine.now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--max-response", type=int, nargs="+", default=[8192, 16384, 28672])
    parser.add_argument("--prompts", type=int, default=128, help="data.train_batch_size")
    parser.add_argument("--n", type=int, default=16, help="rollout.n")
    parser.add_argument("--sigma", type=float, default=0.8, help="sigma of log(response length)")
    parser.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness")
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"llama-7b actor + ref, H100s (cost model + decode simulation); {args.prompts} prompts x {args.n} per "
        f"iteration, {PROMPT}-token prompts, log-normal responses (sigma {args.sigma}); staleness {args.staleness}"
    )
    print(f"{'GPUs':>5} {'longest':>8} {'mode':>13} {'split':>8} {'s/it':>8} {'speedup':>8} {'KV use':>9}")
    for gpus in args.gpus:
        for longest in args.max_response:
            base, base_use = simulate("sync", gpus, gpus, args, longest)
            print(f"{gpus:>5} {longest:>8} {'sync':>13} {'shared':>8} {base:>8.1f} {1.0:>7.2f}x {base_use:>9.0%}")
            for mode in ("batch", "stream", "stream-drain"):
                best = None
                for gen_gpus in range(GPUS_PER_NODE, gpus, GPUS_PER_NODE):
                    seconds, use = simulate(mode, gpus, gen_gpus, args, longest)
                    if best is None or seconds < best[0]:
                        best = (seconds, gen_gpus, use)
                seconds, gen_gpus, use = best
                split = f"{gen_gpus}:{gpus - gen_gpus}"
                print(
                    f"{gpus:>5} {longest:>8} {mode:>13} {split:>8} {seconds:>8.1f} {base / seconds:>7.2f}x {use:>9.0%}"
                )
    print("\npublished speedups (their models, workloads and hardware):")
    for system, speedup in PUBLISHED:
        print(f"  {system}: {speedup}")


if __name__ == "__main__":
    main()
