"""Parallel layouts of the actor: the training layout p-t-d and the generation layout p_g-t_g-d_g-d of the
3D-HybridEngine (HybridFlow, arXiv 2409.19256, section 5.2 and Figure 8), as rank groups.

Training ranks follow megatron-core's order (TP fastest, then DP, then PP)::

    rank = (pp * d + dp) * t + tp          pp in [0, p), dp in [0, d), tp in [0, t)

The generation layout keeps the same devices. With ``s_t = t / t_g`` and ``s_p = p / p_g``, a rank's generation
coordinates are ``gen_tp = tp // s_t`` and ``gen_pp = pp // s_p``; its micro-data-parallel index is
``(pp % s_p) * s_t + tp % s_t``, so ``d_g = s_t * s_p = p * t / (p_g * t_g)`` generation replicas share each
training model-parallel group. The paper's grouping:

- a generation TP group takes the ranks of one training TP group at stride ``s_t`` (and a generation PP group the
  stages at stride ``s_p``);
- a micro-DP group is the ``s_t`` consecutive TP ranks (times ``s_p`` consecutive stages) whose training shards
  together make one generation shard, so the transition all-gathers inside micro-DP groups only and each rank's
  training shard is a piece of its own generation shard.

The paper's example, 8 devices, training 1-4-2, generation 1-2-2-2: generation TP groups [0,2], [1,3], [4,6], [5,7];
micro-DP groups [0,1], [2,3], [4,5], [6,7].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    """A rank's training coordinates ``(pp, dp, tp)`` and generation coordinates."""

    pp: int
    dp: int
    tp: int
    gen_pp: int
    gen_tp: int
    micro_pp: int  # pp % s_p: which of the micro-DP group's stages this rank trains
    micro_tp: int  # tp % s_t: which piece of the generation TP shard this rank's training shard is


@dataclass(frozen=True)
class HybridLayout:
    """Training layout ``p-t-d`` and generation layout ``p_g-t_g`` (``d_g`` follows) over ``p * t * d`` ranks.

    Raises:
        ValueError: a size below 1, or ``t_g`` not dividing ``t`` / ``p_g`` not dividing ``p`` (the generation
            shard must be a union of training shards); the message names the config keys.
    """

    p: int
    t: int
    d: int
    p_g: int
    t_g: int

    def __post_init__(self) -> None:
        keys = ("actor.pp", "actor.tp", "data-parallel size", "rollout.gen_pp", "rollout.gen_tp")
        for key, value in zip(keys, (self.p, self.t, self.d, self.p_g, self.t_g), strict=True):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.t % self.t_g:
            raise ValueError(f"rollout.gen_tp ({self.t_g}) must divide the training actor.tp ({self.t})")
        if self.p % self.p_g:
            raise ValueError(f"rollout.gen_pp ({self.p_g}) must divide the training actor.pp ({self.p})")

    @property
    def world_size(self) -> int:
        return self.p * self.t * self.d

    @property
    def s_t(self) -> int:
        """TP stride of the generation TP groups (= training TP ranks per generation TP shard)."""
        return self.t // self.t_g

    @property
    def s_p(self) -> int:
        """PP stride of the generation PP groups (= training stages per generation stage)."""
        return self.p // self.p_g

    @property
    def d_g(self) -> int:
        """Micro-DP size: generation replicas per training model-parallel group, ``p * t / (p_g * t_g)``."""
        return self.s_t * self.s_p

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at training coordinates (megatron-core order: TP fastest, then DP, then PP)."""
        return (pp * self.d + dp) * self.t + tp

    def coords(self, rank: int) -> Coords:
        """Training and generation coordinates of `rank`. Raises ValueError when it is outside the layout."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        tp = rank % self.t
        dp = rank // self.t % self.d
        pp = rank // (self.t * self.d)
        return Coords(pp, dp, tp, pp // self.s_p, tp // self.s_t, pp % self.s_p, tp % self.s_t)

    def mesh_coords(self, rank: int, mesh: str) -> tuple[int, int, bool]:
        """`rank`'s ``(data-parallel index, data-parallel size, collect)`` on `mesh` (`hybridflow.engine.transfer`):

        - ``train``: its training replica (the ranks of one model-parallel group share rows); the last pipeline
          stage's first TP rank collects;
        - ``generate``: its generation replica (a generation TP group, `gen_tp_groups`); its first rank collects.

        With p = t = 1 (ddp) every rank is a replica of its own on both meshes.

        Raises:
            ValueError: an unknown mesh, or `rank` outside the layout.
        """
        c = self.coords(rank)
        if mesh == "train":
            return c.dp, self.d, c.pp == self.p - 1 and c.tp == 0
        if mesh == "generate":
            groups = self.gen_tp_groups()
            return next(i for i, g in enumerate(groups) if rank in g), len(groups), c.gen_tp == 0
        raise ValueError(f"unknown mesh {mesh!r}; the actor's meshes are train and generate")

    # ------------------------------------------------------------------ groups (lists of global ranks)
    def micro_dp_groups(self) -> list[list[int]]:
        """Ranks whose training shards together form one generation shard; ordered by micro index
        ``micro_pp * s_t + micro_tp``."""
        groups = []
        for dp in range(self.d):
            for gen_pp in range(self.p_g):
                for gen_tp in range(self.t_g):
                    groups.append(
                        [
                            self.rank(gen_pp * self.s_p + a, dp, gen_tp * self.s_t + b)
                            for a in range(self.s_p)
                            for b in range(self.s_t)
                        ]
                    )
        return groups

    def gen_tp_groups(self) -> list[list[int]]:
        """Generation tensor-parallel groups: training TP ranks at stride ``s_t``."""
        return [
            [self.rank(pp, dp, b + k * self.s_t) for k in range(self.t_g)]
            for pp in range(self.p)
            for dp in range(self.d)
            for b in range(self.s_t)
        ]

    def gen_pp_groups(self) -> list[list[int]]:
        """Generation pipeline groups: training stages at stride ``s_p``."""
        return [
            [self.rank(a + k * self.s_p, dp, tp) for k in range(self.p_g)]
            for a in range(self.s_p)
            for dp in range(self.d)
            for tp in range(self.t)
        ]

    def model_parallel_groups(self) -> list[list[int]]:
        """Training model-parallel groups (all TP ranks of all stages of one data-parallel replica)."""
        return [[self.rank(pp, dp, tp) for pp in range(self.p) for tp in range(self.t)] for dp in range(self.d)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        """The group in `groups` that holds `rank`."""
        return next(g for g in groups if rank in g)

    def describe(self) -> dict:
        """The layout and its groups, for the run store's placement record."""
        return {
            "train": {"pp": self.p, "tp": self.t, "dp": self.d},
            "generate": {"pp": self.p_g, "tp": self.t_g, "micro_dp": self.d_g, "replicas": self.d_g * self.d},
            "gen_tp_groups": self.gen_tp_groups(),
            "micro_dp_groups": self.micro_dp_groups(),
        }
