"""The auto-mapping search (HybridFlow paper, section 6, Algorithm 1).

For every placement (a set partition of the run's models; the actor stands for actor and rollout, which share a
pool), the minimum devices of each colocated set from memory, every allocation of the cluster's devices to the sets
from those minima, each model's best parallel strategy on its allocation (`auto_parallel`, under the set's memory),
and the iteration's latency from the dataflow simulation. Strategies are those a runtime can run with the work it has
(`Planner.has_work`: no data-parallel replica or pipeline stage without sequences). The plan is the lowest latency,
or (the default objective) the fewest devices among the plans within a tolerance of it: an operator does not give
hundreds of devices to a model for 5 % of speed. Per-set choices are cached by (set, devices), so a 1,024-device
cluster plans in seconds."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Literal, get_args

from hybridflow.engine.shapes import ModelShape
from hybridflow.flows.placement.cost import ModelCost, Strategy, Workload, estimate, kv_room_batch
from hybridflow.flows.placement.dataflow import iteration_stages, simulate
from hybridflow.flows.placement.hardware import GB, HardwareProfile

MODELS = ("actor", "critic", "ref", "reward_model", "teacher")
StrategySpace = Literal["runtime", "all"]
Objective = Literal["latency", "throughput-per-gpu"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
TOLERANCE = 0.05  # plans within this fraction of the fastest count as equally fast (fewest devices wins)
# what this runtime can run (hybridflow/engine/config.py): megatron only for the actor, ref a whole copy per rank, the
# critic and
# the reward model ddp or fsdp. "all" is the paper's space: every model in any 3D layout.
RUNTIME_KINDS = {"actor": ("ddp", "fsdp", "megatron"), "critic": ("ddp", "fsdp"), "ref": ("ddp",)}
RUNTIME_KINDS["reward_model"] = ("ddp", "fsdp")
RUNTIME_KINDS["teacher"] = ("ddp",)  # a whole copy per rank, as ref
PER_MODEL = 4  # fastest strategies per model tried in a colocated set (plus its smallest)


class PlanError(ValueError):
    """No plan fits: the message names the memory needed and available per device."""


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every partition of `items` into non-empty sets (Bell(len(items)) of them: 1, 2, 5, 15, 52 ...)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for i, block in enumerate(partition):
            yield [*partition[:i], (first, *block), *partition[i + 1 :]]
        yield [(first,), *partition]


def pool_sizes(nodes: int, gpus_per_node: int) -> list[int]:
    """Device counts a pool may have: a divisor of a node's devices (one node), or whole nodes; beyond 16 nodes,
    powers of two and multiples of nodes/16 only (the search stays small)."""
    sizes = {d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0}
    step = max(1, nodes // 16)
    for k in range(1, nodes + 1):
        if nodes <= 16 or k % step == 0 or k & (k - 1) == 0:
            sizes.add(k * gpus_per_node)
    return sorted(sizes)


def strategies(role: str, shape: ModelShape, devices: int, gpus_per_node: int, space: StrategySpace) -> list[Strategy]:
    """The parallel strategies of `role`'s model on `devices` devices: ddp and fsdp (data parallel over all of
    them) and megatron tp x pp x dp with tp inside a node dividing the attention heads and pp dividing the layers;
    for the actor, every generation t_g dividing tp, and for a mixture-of-experts actor every expert-parallel size
    ep dividing both dp and the expert count (`hybridflow.engine.backends.engines`' rule at expert TP = tp)."""
    kinds = RUNTIME_KINDS[role] if space == "runtime" else ("ddp", "fsdp", "megatron")
    out = [Strategy("ddp", dp=devices)] if "ddp" in kinds else []
    if "fsdp" in kinds and devices > 1:
        out.append(Strategy("fsdp", dp=devices))
    if "megatron" in kinds:
        for tp in range(1, min(devices, gpus_per_node) + 1):
            if devices % tp or shape.heads % tp or shape.kv_heads % tp:
                continue
            for pp in range(1, devices // tp + 1):
                if (devices // tp) % pp or shape.layers % pp or tp * pp == 1:
                    continue
                dp = devices // (tp * pp)
                gen = [g for g in range(1, tp + 1) if tp % g == 0] if role == "actor" else [tp]
                moe = role == "actor" and shape.experts > 1
                eps = [e for e in range(1, dp + 1) if dp % e == 0 and shape.experts % e == 0] if moe else [1]
                out += [Strategy("megatron", tp, pp, dp, g, ep=e) for g in gen for e in eps]
    return out


def set_peak(costs: list[ModelCost]) -> float:
    """Peak bytes per device of models colocated in one pool: what each holds all iteration, plus the largest need
    of any one stage (the pool runs its stages one at a time)."""
    return sum(c.static_bytes for c in costs) + max(max(c.transient_bytes.values(), default=0.0) for c in costs)


@dataclass
class SetChoice:
    """A colocated set on its devices: each model's strategy and estimate, and the set's peak bytes per device."""

    strategies: dict[str, Strategy]
    costs: dict[str, ModelCost]
    peak_bytes: float


@dataclass
class Candidate:
    """One mapping: the sets of models sharing a pool, their devices, each model's strategy; its estimated seconds
    per stage and per iteration, and the peak bytes per device of each pool."""

    placement: tuple[tuple[str, ...], ...]
    devices: tuple[int, ...]
    strategies: dict[str, Strategy]
    stage_s: dict[str, float]
    spans: dict[str, tuple[float, float]]
    seconds: float
    peak_bytes: tuple[float, ...]
    not_runnable: str | None = None  # why this runtime cannot run it (None: it can)

    @property
    def used(self) -> int:
        """Devices the plan's pools take (the rest of the cluster stays idle)."""
        return sum(self.devices)


@dataclass
class Rejected:
    placement: tuple[tuple[str, ...], ...]
    reason: str


@dataclass
class PlanResult:
    """The search's outcome: every feasible candidate in the objective's order (`rank`: the preferred first), the
    placements with no feasible allocation, and the inputs."""

    candidates: list[Candidate]
    rejected: list[Rejected]
    models: dict[str, ModelShape]
    workload: Workload
    hardware: HardwareProfile
    nodes: int
    gpus_per_node: int
    space: StrategySpace
    placements: int = 0
    allocations: int = 0
    notes: list[str] = field(default_factory=list)
    objective: Objective = "latency"
    tolerance: float = TOLERANCE

    @property
    def best(self) -> Candidate:
        """The preferred candidate (`rank`)."""
        return self.candidates[0]

    @property
    def devices(self) -> int:
        """The cluster's devices (nodes x gpus_per_node), used or idle."""
        return self.nodes * self.gpus_per_node

    @property
    def stage_names(self) -> list[str]:
        """The iteration's stages that a model runs, in the flow's order."""
        return [s.name for s in iteration_stages(frozenset(self.models), self.workload.greedy > 0) if s.model]


class Planner:
    """Algorithm 1 over `models` (role -> shape) for `workload` on `nodes` x `gpus_per_node` devices of `hardware`.

    Args:
        space: ``runtime`` plans only strategies this version runs; ``all`` the paper's space (3D for every model).
        concurrent: stages of different pools overlap (``placement.concurrent``).
        objective: ``latency`` (the fewest devices among the plans within `tolerance` of the fastest) or
            ``throughput-per-gpu`` (sequences per second per device used: the fewest device-seconds per iteration).
        tolerance: the fraction of the fastest plan's seconds within which plans count as equally fast."""

    def __init__(
        self,
        models: dict[str, ModelShape],
        workload: Workload,
        hardware: HardwareProfile,
        nodes: int,
        gpus_per_node: int,
        space: StrategySpace = "runtime",
        concurrent: bool = True,
        objective: Objective = "latency",
        tolerance: float = TOLERANCE,
    ):
        unknown = sorted(set(models) - set(MODELS))
        if unknown or "actor" not in models:
            raise ValueError(f"models must include actor and be among {MODELS}; got {sorted(models)}")
        if objective not in OBJECTIVES or tolerance < 0:
            raise ValueError(f"objective must be one of {OBJECTIVES} and tolerance >= 0; got {objective}, {tolerance}")
        self.objective, self.tolerance = objective, tolerance
        self.models = {m: models[m] for m in MODELS if m in models}
        self.workload, self.hw, self.space, self.concurrent = workload, hardware, space, concurrent
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.total = nodes * gpus_per_node
        self.sizes = pool_sizes(nodes, gpus_per_node)
        self.stages = iteration_stages(frozenset(self.models), workload.greedy > 0)
        self._estimate = cache(self._estimate_uncached)
        self._choose = cache(self._choose_uncached)

    def _estimate_uncached(self, role: str, strategy: Strategy) -> ModelCost:
        return estimate(role, self.models[role], strategy, self.workload, self.hw, self.gpus_per_node)

    def has_work(self, role: str, s: Strategy) -> bool:
        """Whether every replica and pipeline stage of `role`'s model under `s` gets work, as the runtime splits it:
        the actor's and critic's data-parallel ranks share each optimizer step's mini-batch (``runtime`` space: in
        equal parts, `HybridFlowConfig._divisible_by_ranks`), the ref's and reward model's the iteration's sequences,
        the rollout's replicas (devices / t_g) the generated ones; a pipeline of p stages needs p micro-batches per
        step in flight (fewer leave stages with nothing to do: GPipe/1F1B's bubble, Narayanan et al. 2021,
        section 2.2)."""
        w = self.workload
        if role in ("actor", "critic"):
            steps, epochs = (w.actor_steps, w.actor_epochs) if role == "actor" else (w.critic_steps, w.critic_epochs)
            rows = w.sequences // max(1, steps // max(1, epochs))  # sequences of one optimizer step
            micro = w.train_micro_batch if role == "actor" else w.critic_micro_batch
            if s.dp > rows or (self.space == "runtime" and rows % s.dp):
                return False
        else:
            rows, micro = w.sequences, w.infer_micro_batch
            if s.dp > rows:
                return False
        if s.pp > 1 and math.ceil(rows / s.dp / micro) < s.pp:
            return False
        return role != "actor" or s.rollout_replicas <= (w.generated or w.sequences)

    def _strategies(self, role: str, devices: int) -> list[Strategy]:
        """`strategies` of `role` on `devices` that give every replica and stage work (`has_work`)."""
        found = strategies(role, self.models[role], devices, self.gpus_per_node, self.space)
        return [s for s in found if self.has_work(role, s)]

    def _choose_uncached(self, models: tuple[str, ...], devices: int) -> SetChoice | None:
        """The fastest strategies for a colocated set on `devices` whose peak fits a device (None: nothing fits).
        Each model tries its `PER_MODEL` fastest strategies and its smallest; the set's peak is the sum of what
        every model holds all iteration plus the largest transient need of any one stage (stages run in turn)."""
        options = []
        for role in models:
            costed = [(s, self._estimate(role, s)) for s in self._strategies(role, devices)]
            if not costed:
                return None
            fastest = sorted(costed, key=lambda sc: sc[1].seconds)[:PER_MODEL]
            smallest = min(costed, key=lambda sc: sc[1].peak_bytes)
            options.append(fastest + ([smallest] if smallest not in fastest else []))
        best: SetChoice | None = None
        best_s = math.inf
        for combo in itertools.product(*options):
            combo = self._fit_rollout(models, combo)
            if combo is None:
                continue
            peak = set_peak([c for _, c in combo])
            seconds = sum(c.seconds for _, c in combo)
            if peak <= self.hw.capacity_bytes and seconds < best_s:
                best_s = seconds
                best = SetChoice(
                    {r: s for r, (s, _) in zip(models, combo, strict=True)},
                    {r: c for r, (_, c) in zip(models, combo, strict=True)},
                    peak,
                )
        return best

    def _fit_rollout(
        self, models: tuple[str, ...], combo: tuple[tuple[Strategy, ModelCost], ...]
    ) -> tuple[tuple[Strategy, ModelCost], ...] | None:
        """`combo` (a strategy and estimate per model of a colocated set) with the rollout's batch cut to what its
        KV cache has room for beside everything the set holds all iteration (`cost.kv_room_batch`): colocated
        models leave the rollout less memory, so it decodes fewer sequences at once and takes more steps. Unchanged
        without the actor or where its batch fits; None where not one sequence does."""
        if "actor" not in models:
            return combo
        index = models.index("actor")
        s, _ = combo[index]
        room = self.hw.capacity_bytes - sum(cost.static_bytes for _, cost in combo)
        fits = kv_room_batch(room, self.models["actor"], s, self.workload, self.hw)
        per_replica = math.ceil((self.workload.generated or self.workload.sequences) / s.rollout_replicas)
        if fits >= min(per_replica, s.gen_batch or self.workload.gen_micro_batch):
            return combo
        if fits < 1:
            return None
        s = replace(s, gen_batch=fits)
        return (*combo[:index], (s, self._estimate("actor", s)), *combo[index + 1 :])

    def smallest_peak(self, models: tuple[str, ...], devices: int) -> float:
        """The least peak bytes per device of a set on `devices` (for messages)."""
        smallest = []
        for role in models:
            costs = [
                self._estimate(role, s)
                for s in strategies(role, self.models[role], devices, self.gpus_per_node, self.space)
            ]
            if not costs:
                return math.inf
            smallest.append(min(costs, key=lambda c: c.peak_bytes))
        return set_peak(smallest)

    def min_devices(self, models: tuple[str, ...]) -> int | None:
        """A_min: the fewest devices (among `pool_sizes`) on which the set fits with work for every replica; None if
        it fits on none."""
        for size in self.sizes:
            if size <= self.total and self._choose(models, size) is not None:
                return size
        return None

    def allocations(self, minima: list[int]) -> Iterator[tuple[int, ...]]:
        """Device counts for the sets, each at least its minimum (among `pool_sizes`), together at most the cluster:
        fewer than all devices too, since more devices may give a model no faster plan (or nothing to do)."""
        choices = [[s for s in self.sizes if s >= low] for low in minima]
        for sizes in itertools.product(*choices):
            if sum(sizes) <= self.total:
                yield sizes

    def search(self) -> PlanResult:
        """Run the search. Returns every feasible candidate, fastest first.

        Raises:
            PlanError: no placement fits, naming the memory the smallest layout needs per device."""
        result = PlanResult([], [], self.models, self.workload, self.hw, self.nodes, self.gpus_per_node, self.space)
        result.objective, result.tolerance = self.objective, self.tolerance
        for partition in set_partitions(list(self.models)):
            placement = tuple(sorted(partition, key=lambda block: MODELS.index(block[0])))  # the actor's pool first
            if self.workload.lora_rank and "ref" in self.models and "ref" not in placement[0]:
                continue  # LoRA: the reference is the actor's model (adapter off), in the actor's processes
            result.placements += 1
            minima = [self.min_devices(models) for models in placement]
            if None in minima:
                models = placement[minima.index(None)]
                need = self.smallest_peak(models, self.total)
                result.rejected.append(
                    Rejected(
                        placement,
                        f"{'+'.join(models)} does not fit even on all {self.total} devices: needs "
                        f"{need / GB:.1f} GB per device, {self.hw.capacity_bytes / GB:.1f} GB usable",
                    )
                )
                continue
            if sum(minima) > self.total:
                result.rejected.append(
                    Rejected(
                        placement,
                        f"needs {sum(minima)} devices at least ({' + '.join(map(str, minima))}), "
                        f"the cluster has {self.total}",
                    )
                )
                continue
            for devices in self.allocations(minima):
                result.allocations += 1
                candidate = self.evaluate(placement, devices)
                if candidate is not None:
                    result.candidates.append(candidate)
        if not result.candidates:
            raise PlanError(self._nothing_fits(result))
        result.candidates = rank(result.candidates, self.objective, self.tolerance)
        return result

    def evaluate(self, placement: tuple[tuple[str, ...], ...], devices: tuple[int, ...]) -> Candidate | None:
        """The estimate of one mapping (None if a set does not fit its devices)."""
        chosen: dict[str, Strategy] = {}
        stage_s: dict[str, float] = {}
        peaks = []
        pool_of: dict[str, int] = {}
        for index, (models, size) in enumerate(zip(placement, devices, strict=True)):
            choice = self._choose(models, size)
            if choice is None:
                return None
            peaks.append(choice.peak_bytes)
            for role in models:
                pool_of[role] = index
                chosen[role] = choice.strategies[role]
                stage_s.update(choice.costs[role].stage_s)
        seconds, spans = self._simulate(pool_of, devices, stage_s)
        return Candidate(
            placement,
            devices,
            chosen,
            _durations(spans, stage_s),
            spans,
            seconds + self.hw.iteration_overhead_s,
            tuple(peaks),
        )

    def estimate_mapping(
        self, placement: tuple[tuple[str, ...], ...], devices: tuple[int, ...], chosen: dict[str, Strategy]
    ) -> Candidate:
        """The estimate of a mapping whose strategies are given (a run config's own placement), fit or not."""
        stage_s: dict[str, float] = {}
        peaks, pool_of = [], {}
        for index, models in enumerate(placement):
            costs = [self._estimate(role, chosen[role]) for role in models]
            peaks.append(set_peak(costs))
            for role, cost in zip(models, costs, strict=True):
                pool_of[role] = index
                stage_s.update(cost.stage_s)
        seconds, spans = self._simulate(pool_of, devices, stage_s)
        seconds += self.hw.iteration_overhead_s
        return Candidate(placement, devices, dict(chosen), _durations(spans, stage_s), spans, seconds, tuple(peaks))

    def _simulate(self, pool_of: dict[str, int], devices: tuple[int, ...], stage_s: dict[str, float]):
        hw = self.hw
        return simulate(self.stages, pool_of, stage_s, self.concurrent, devices, hw.host_cores, hw.contended_stage_s)

    def _nothing_fits(self, result: PlanResult) -> str:
        everything = tuple(self.models)
        need = self.smallest_peak(everything, self.total)
        lines = [
            f"no placement fits {self.total} devices of {self.hw.capacity_bytes / GB:.1f} GB usable "
            f"({self.hw.name}): all models together need {need / GB:.1f} GB per device in their smallest layout"
        ]
        for role, shape in self.models.items():
            alone = self.smallest_peak((role,), self.total)
            params = shape.params("lm" if role in ("actor", "ref", "teacher") else "value") / 1e9
            lines.append(
                f"  {role} ({shape.name}, {params:.2f} B parameters) alone: {alone / GB:.1f} GB per device "
                f"on {self.total} devices"
            )
        lines.append(
            "Use more nodes (--nodes), a device with more memory (--gpu / --gpu-memory-gb), a smaller model, or "
            "shorter sequences / smaller micro-batches (data.max_prompt_length, rollout.response_length, "
            "actor.ppo_micro_batch_size)"
        )
        return "\n".join(lines)


def rank(candidates: list[Candidate], objective: Objective, tolerance: float) -> list[Candidate]:
    """`candidates` in the order of preference. ``latency``: those within `tolerance` of the fastest first, fewest
    devices first among them (then faster), then the rest fastest first; ``throughput-per-gpu``: fewest device-seconds
    per iteration first (the most sequences per second per device used), then faster."""
    by_speed = sorted(candidates, key=lambda c: (c.seconds, c.used, len(c.placement)))
    if objective == "throughput-per-gpu":
        return sorted(by_speed, key=lambda c: c.seconds * c.used)
    limit = by_speed[0].seconds * (1 + tolerance) if by_speed else 0.0
    near = sorted((c for c in by_speed if c.seconds <= limit), key=lambda c: c.used)
    return near + [c for c in by_speed if c.seconds > limit]


def _durations(spans: dict[str, tuple[float, float]], stage_s: dict[str, float]) -> dict[str, float]:
    """Each model stage's simulated seconds (its cost, plus contention where the profile has it)."""
    return {name: spans[name][1] - spans[name][0] for name in stage_s}
