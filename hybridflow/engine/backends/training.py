"""Pieces shared by the actor and critic updates: optimizer, LR schedule, mini-batches, micro-batch loss weights,
data-parallel gradient synchronisation, the optimizer step, metric averaging.

Data parallelism. With a worker group of D ranks, every rank holds a full replica of the trained model
(``torch.nn.parallel.DistributedDataParallel``; FSDP2's ``fully_shard`` would all-gather weights inside every
forward, and the colocated rollout's ``generate`` runs a different number of forwards on each rank, which would
deadlock) and receives a contiguous 1/D of the batch. Each rank splits its share into mini-batches of
``ppo_mini_batch_size x n / D`` sequences (as verl does): optimizer step k updates on the union of the ranks' k-th
local mini-batches. The micro-batch loss weights are normalised by the token (or sequence) count of that global
mini-batch, summed over ranks with an all-reduce, and DDP's gradient all-reduce then sums the ranks'
contributions, so each step's gradient is exactly the gradient of the global mini-batch's loss in one piece: a
DP=2 update equals the DP=1 update on the same mini-batches, up to float summation order.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.engine.algorithms.losses import update_agg_mode
from hybridflow.engine.config import OptimConfig
from hybridflow.engine.guards import FIX, NonFiniteError
from hybridflow.engine.packing import prompt_groups
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import AGG_LOSS_MODES


def build_optimizer(
    model: torch.nn.Module, optim: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, and its learning-rate schedule (`LRSchedule`: linear warm-up over
    ``optim.warmup_steps`` optimizer steps or ``optim.warmup_iterations`` training iterations, then constant or,
    ``optim.lr_scheduler_type: cosine``, a cosine decay by iteration).

    The fused implementation (one kernel over all parameters, CPU and CUDA; the same update as the per-tensor
    one up to float rounding): on this 2-core CPU it steps SmolLM2-135M in 75 ms instead of 450 ms."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=True)
    schedule = LRSchedule(
        optim.warmup_steps,
        optim.warmup_iterations,
        cosine=optim.lr_scheduler_type == "cosine",
        decay_iterations=optim.decay_iterations,
        min_lr_ratio=optim.min_lr_ratio,
        num_cycles=optim.num_cycles,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class LRSchedule:
    """The learning-rate factor of an optimizer step (``torch.optim.lr_scheduler.LambdaLR``'s function of the steps
    taken), times one of the training iteration the step belongs to:

    - ``warmup_steps`` w_s > 0: ``min(1, (s + 1) / w_s)`` at optimizer step s (from 0): the first step at lr / w_s;
    - ``warmup_iterations`` w_i > 0: ``min(1, i / w_i)`` through iteration i (from 0: the first iteration at lr 0),
      whatever the number of optimizer steps in an iteration: verl's ``lr_warmup_steps`` with its constant
      schedule (``verl/utils/torch_functional.py::get_constant_schedule_with_warmup``, stepped once per actor or
      critic update);
    - ``cosine`` (after the per-iteration warm-up): ``r + (1 - r) * (1 + cos(2 pi c p)) / 2`` at iteration i, with
      progress ``p = min(1, (i - w_i) / max(1, T - w_i))``, ``r`` = `min_lr_ratio`, ``c`` = `num_cycles`, T =
      `decay_iterations`: verl's ``get_cosine_schedule_with_warmup`` (same file; VeOmni's and megatron-core's cosine
      are the same curve with T their decay steps), except that p stops at 1, so iterations past T (a run extended
      on resume) stay at lr x r instead of climbing the cosine back up.

    The iteration is set by `start_iteration` from the batch's ``global_steps``, so a resumed run needs no saved
    state for it.
    """

    def __init__(
        self,
        warmup_steps: int = 0,
        warmup_iterations: int = 0,
        cosine: bool = False,
        decay_iterations: int = 0,
        min_lr_ratio: float = 0.0,
        num_cycles: float = 0.5,
    ):
        self.warmup_steps, self.warmup_iterations, self.iteration = warmup_steps, warmup_iterations, 0
        self.cosine, self.decay_iterations = cosine, decay_iterations
        self.min_lr_ratio, self.num_cycles = min_lr_ratio, num_cycles

    def per_iteration(self) -> bool:
        """Whether the factor depends on the iteration (`start_iteration` must set it)."""
        return self.warmup_iterations > 0 or self.cosine

    def __call__(self, step: int) -> float:
        per_step = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        i, warmup = self.iteration, self.warmup_iterations
        if warmup > 0 and i < warmup:
            return per_step * i / warmup
        if not self.cosine:
            return per_step
        progress = min(1.0, (i - warmup) / max(1, self.decay_iterations - warmup))
        wave = 0.5 * (1.0 + math.cos(2.0 * math.pi * self.num_cycles * progress))
        return per_step * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * wave)


def start_iteration(scheduler: torch.optim.lr_scheduler.LRScheduler, global_steps: int) -> None:
    """Set the learning rates of `scheduler`'s optimizer for training iteration `global_steps` (from 1, as
    ``meta_info["global_steps"]``), before its first optimizer step; a no-op unless the schedule is per iteration
    (``warmup_iterations`` or ``cosine``)."""
    schedule = scheduler.lr_lambdas[0] if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None
    if not isinstance(schedule, LRSchedule) or not schedule.per_iteration():
        return
    schedule.iteration = max(0, global_steps - 1)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * schedule(scheduler.last_epoch)


def mini_batches(
    data: DataProto,
    mini_batch_size: int,
    epochs: int,
    shuffle: bool,
    seed: tuple[int, ...],
    groups: torch.Tensor | None = None,
) -> Iterator[DataProto]:
    """Yield `epochs` passes over `data` in mini-batches of `mini_batch_size` sequences.

    Each epoch's order is ``np.random.default_rng([*seed, epoch]).permutation`` when `shuffle`, so the order is
    a pure function of (seed, epoch): nothing to checkpoint. With `groups` (int [G], sizes of runs of consecutive
    rows summing to ``len(data)``: a prompt's samples, `hybridflow.engine.packing.prompt_groups`) the groups are
    permuted and each keeps its rows together, so its prompt stays shared in the micro-batches.

    Raises:
        ValueError: if ``len(data)`` is not a multiple of `mini_batch_size` (names the config keys).
    """
    n = len(data)
    if n % mini_batch_size:
        raise ValueError(
            f"batch of {n} sequences is not a multiple of the mini-batch size {mini_batch_size} sequences "
            "(ppo_mini_batch_size x rollout.n); adjust data.train_batch_size or ppo_mini_batch_size"
        )
    sizes = np.ones(n, dtype=np.int64) if groups is None else groups.numpy()  # no groups: every row its own
    blocks = np.split(np.arange(n), np.cumsum(sizes)[:-1])
    for epoch in range(epochs):
        picked = np.random.default_rng([*seed, epoch]).permutation(len(blocks)) if shuffle else range(len(blocks))
        shuffled = data[np.concatenate([blocks[b] for b in picked])]
        yield from shuffled.split(mini_batch_size)


def update_steps(
    data: DataProto,
    mini_batch_size: int,
    config,
    seed: int,
    stream: int,
    group: dist.ProcessGroup | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> Iterator[tuple[list[DataProto], list[float]]]:
    """The optimizer steps of one PPO update on this rank's rows: for each mini-batch (`mini_batches`, shuffled
    with ``(seed, meta_info["global_steps"], stream)``; stream 0 for the actor, 1 for the critic), its micro-batches
    of ``config.ppo_micro_batch_size`` sequences and their loss weights (`micro_batch_weights` over `group`).
    `scheduler` (the role's) is set to this iteration first (`start_iteration`).

    `config` is the ``actor`` or ``critic`` section (``ppo_epochs``, ``shuffle``, ``ppo_micro_batch_size``,
    ``loss_agg_mode``, or `update_agg_mode`'s for its policy loss; a section that `shares_prompts` shuffles a
    prompt's samples together)."""
    order = (seed, int(data.meta_info.get("global_steps", 0)), stream)
    policy_loss = getattr(config, "policy_loss", None)  # a sequence-mean loss combines by sequences (GMPO)
    mode = update_agg_mode(config.loss_agg_mode, policy_loss.loss_mode if policy_loss is not None else None)
    if scheduler is not None:
        start_iteration(scheduler, order[1])
    groups = prompt_groups(data) if getattr(config, "shares_prompts", False) else None
    for mini in mini_batches(data, mini_batch_size, config.ppo_epochs, config.shuffle, order, groups):
        micros = mini.split(config.ppo_micro_batch_size)
        yield micros, micro_batch_weights(micros, mode, group=group)


@contextlib.contextmanager
def update_random_stream(seed: int, data: DataProto, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run an update on a CPU random stream of its own, seeded with ``(seed, meta_info["global_steps"], rank in
    group)``, and give the global stream back as it was after: a random draw of the update (Clip-Cov's tokens) is
    then a pure function of the seed and the iteration, so a flow run resumed from a checkpoint (whose workers'
    global generators start afresh) repeats it exactly, and the draws do not shift any other stream."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    steps = int(data.meta_info.get("global_steps", 0))
    state = np.random.SeedSequence([seed, steps, rank]).generate_state(1)[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(state))
        yield


def dp_world() -> tuple[int, int]:
    """(rank, size) of the data-parallel group: torch.distributed's default group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def data_parallel(
    model: torch.nn.Module, strategy: str = "ddp", tp: int = 1
) -> tuple[torch.nn.Module, dist.ProcessGroup | None]:
    """The module to train `model` through and the data-parallel group (None: torch.distributed's default group, or
    no group on one rank), as the training backend `strategy` wraps it (`hybridflow.engine.backends.engines.HFBackend.
    data_parallel`: ``ddp`` replicates, ``fsdp`` shards in place). Gradients are all-reduced in the last backward of
    each mini-batch, see `sync_gradients`.

    Raises:
        ValueError: `strategy` is not registered, or trains a model of its own (megatron).
    """
    from hybridflow.engine.extensions import training_backend

    return training_backend(strategy).data_parallel(model, tp)


def sync_gradients(module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's backward: all-reduce gradients only when `sync` (the mini-batch's last
    micro-batch); the others accumulate locally (``DistributedDataParallel.no_sync``, or FSDP2's
    ``set_requires_gradient_sync``)."""
    from hybridflow.engine.backends.fsdp import gradient_sync
    from hybridflow.engine.sharded_state import is_sharded

    if is_sharded(module):
        return gradient_sync(module, sync)
    if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return module.no_sync()


def micro_batch_weights(
    micros: Sequence[DataProto],
    loss_agg_mode: str,
    group: dist.ProcessGroup | None = None,
    mask_key: str = "response_mask",
) -> list[float]:
    """Weights that turn per-micro-batch losses into the loss of their whole (global) mini-batch.

    Each micro-batch loss is aggregated over the micro-batch alone (`torch_ops.agg_loss`); backpropagating
    ``sum_i w_i * loss_i`` accumulates the gradient of the mini-batch loss aggregated in one piece when

    - ``"token-mean"`` (a mean over tokens): ``w_i`` = response tokens of micro-batch i / response tokens of the
      mini-batch (``response_mask`` sums), so every token weighs the same however the batch is split;
    - ``"token-sum"`` (a sum over tokens): ``w_i`` = 1, the micro-batches' sums add up to the mini-batch's;
    - ``"seq-mean-token-sum"``, ``"seq-mean-token-mean"`` (means over the sequences that have a response token):
      ``w_i`` = such sequences in micro-batch i / such sequences in the mini-batch (= ``len(micro) / len(mini)``
      for rollout batches, where every response has at least one token);
    - ``"seq-mean-token-sum-norm"`` (a token sum over the constant ``B * T``): ``w_i = len(micro) / len(mini)``.

    A mini-batch with no response token at all gets weights 0 (its losses are 0 in every mode).

    With several data-parallel ranks the denominator counts the global mini-batch (an all-reduce over the ranks'
    counts; every rank must call this for each mini-batch), and the weights are multiplied by the number of ranks
    to undo DDP's gradient averaging: the ranks' weights then sum to D and their averaged gradient is the global
    mini-batch's.

    Args:
        micros: this rank's micro-batches of one mini-batch, each with ``response_mask`` [b_i, T] (0/1).
        loss_agg_mode: one of `torch_ops.AGG_LOSS_MODES` (``actor.loss_agg_mode`` / ``critic.loss_agg_mode``).
        group: the data-parallel group (default: torch.distributed's default group, as `dp_world`; megatron passes
            its data-parallel group).
        mask_key: the column that marks the trained tokens (SFT: ``loss_mask``).

    Returns:
        One float per micro-batch; with one rank they sum to 1 (or all 0, see above; ``token-sum``: each is 1).

    Raises:
        ValueError: unknown `loss_agg_mode` (lists the allowed values).
    """
    if loss_agg_mode not in AGG_LOSS_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {list(AGG_LOSS_MODES)}")
    world = dist.get_world_size(group) if group is not None else dp_world()[1]
    if loss_agg_mode == "token-sum":
        return [float(world)] * len(micros)  # times the ranks: DDP averages the ranks' gradients
    if loss_agg_mode == "token-mean":
        counts = [float((m.batch[mask_key] != 0).sum()) for m in micros]
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        counts = [float(len(m)) for m in micros]
    else:
        counts = [float((m.batch[mask_key] != 0).any(dim=-1).sum()) for m in micros]
    total = sum(counts)
    if world > 1:
        on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        summed = torch.tensor([total], dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=group)
        total = float(summed)
    return [world * c / total if total > 0 else 0.0 for c in counts]


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip a Hugging Face model's gradients to a global 2-norm of `max_norm` (``torch.nn.utils.clip_grad_norm_``;
    FSDP and TP shards on meshes of 1 or 2 dimensions summed over their mesh). Returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if any(isinstance(g, DTensor) for g in grads):
        squares = [g.norm() ** 2 for g in grads]
        grad_norm = sum(s.full_tensor() if isinstance(s, DTensor) else s for s in squares).sqrt()
        if grad_norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (grad_norm + 1e-6))  # as clip_grad_norm_
        return float(grad_norm)
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    role: str = "actor",
    log: MetricLog | None = None,
    clip: Callable[[torch.nn.Module, float], float] = clip_grad_norm,
) -> dict[str, float]:
    """The one optimizer step of every backend, after a mini-batch's gradients are accumulated (and, where the
    backend does not, averaged over its data-parallel ranks): clip the global grad norm to `grad_clip` with `clip`
    (this module's `clip_grad_norm`; megatron's over its model-parallel group), step, advance the schedule, zero
    the grads.

    Args:
        role: ``actor``, ``critic``, ``cost_critic`` or ``rm``, for the error message.
        log: the update's metric log; its non-finite values of this mini-batch (a NaN loss) are named in the error.

    Returns:
        ``grad_norm`` (the global norm before clipping) and ``lr`` (the rate this step used).

    Raises:
        NonFiniteError: the grad norm is NaN or infinite (`stop_on_non_finite_grad`): nothing is stepped.
    """
    lr = optimizer.param_groups[0]["lr"]  # what this step uses (set by the schedule, or `start_iteration`)
    grad_norm = clip(model, grad_clip)
    stop_on_non_finite_grad(grad_norm, optimizer, role, log)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr}


def stop_on_non_finite_grad(grad_norm: float, optimizer, role: str, log: MetricLog | None) -> None:
    """Raise `NonFiniteError` (after zeroing the grads, before any step) if `grad_norm` is NaN or ±inf.

    The norm is global over the model's shards and data-parallel ranks (the gradients are all-reduced first), so
    every rank raises together and none is left waiting in a collective. The message names ``<role>/grad_norm`` and
    the metrics of this mini-batch that are themselves non-finite on this rank (``actor/pg_loss``, ...).
    """
    if math.isfinite(grad_norm):
        return
    optimizer.zero_grad(set_to_none=True)
    bad = [f"{role}/{name}" for name in (log.non_finite_last() if log is not None else [])]
    cause = f" (non-finite in this mini-batch: {', '.join(bad)})" if bad else ""
    raise NonFiniteError(f"update_{role}: {role}/grad_norm is {grad_norm}{cause}; the weights were not stepped; {FIX}")


class MaskedMeans:
    """Token-weighted means over micro-batches: `add` accumulates a [b, T] tensor's sum over the mask's tokens and
    the token count under a metric name; `means` gives each name's sum / count, the masked mean over every row
    added (what `masked_mean` of the whole batch gives, whatever the micro-batches' token counts)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Add ``values`` float [b, T] over ``mask`` (0/1, [b, T]) under `name` (e.g. ``actor/entropy``)."""
        values = values.detach().float()
        self._sums[name] += float((values * mask).sum())
        self._counts[name] += float(mask.sum())

    def means(self) -> dict[str, float]:
        """name -> masked mean (NaN for a name whose mask had no token)."""
        return {k: self._sums[k] / self._counts[k] if self._counts[k] else math.nan for k in self._sums}


class MetricLog:
    """Collect per-micro/mini-batch values under metric names; `mean()` averages each name."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, **values: float | torch.Tensor) -> None:
        """Record one value per keyword: ``log.add(pg_loss=loss, lr=1e-6)``.

        Args:
            values: metric name -> a Python number or a one-element tensor (detached and moved to a float).

        Raises:
            ValueError: a tensor with more than one element, or a string ``float()`` cannot parse. TypeError: a value
                of another type that ``float()`` rejects.
        """
        for name, value in values.items():
            self._values[name].append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))

    def mean(self, prefix: str) -> dict[str, float]:
        """The unweighted mean of every name's recorded values, keyed ``"<prefix>/<name>"`` (e.g. ``actor/pg_loss``).

        Returns:
            name -> float, in first-recorded order; empty when nothing was recorded.
        """
        return {f"{prefix}/{k}": float(np.mean(v)) for k, v in self._values.items()}

    def non_finite_last(self) -> list[str]:
        """The names whose most recent value is NaN or ±inf."""
        return [name for name, values in self._values.items() if values and not math.isfinite(values[-1])]
