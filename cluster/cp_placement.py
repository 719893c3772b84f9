"""Where context-parallel ranks run and which of them hold which pages of a request.

    ranks = place_ranks(config, cpu, nodes, timeout_s)        # a placement group: a bundle per rank
    nodes = ranks.remaining(nodes)                            # what the workers are planned on
    start_ranks(ranks, config, namespace, cpu, timeout_s)     # a CpRank actor per bundle
    plan_shards(free_pages_by_rank, total_pages, tail_pages)  # admission: ShardRange per rank

Placement: `context_parallel.ranks` CpRank actors (workers/cp_actors.py), one per lockserve node in a
STRICT_SPREAD placement group (SPREAD when there are fewer nodes than ranks), each with the whole
model and `context_parallel.host_capacity_gib` of KV pages from its node's page store. The group is
placed before the workers are planned, which get the GPUs and CPUs its bundles leave.

Admission (`plan_shards`, pure): a request's pages (prompt + max_tokens) go to the fewest ranks
whose free pages hold them, in contiguous ranges balanced within each rank's free pages; the rank
with the most free pages goes last and holds every page from the first new token's on (rank 0
holds the sink).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from lockserve.cluster.placement import NodeInfo
from lockserve.configs.loader import ConfigError
from lockserve.configs.schema import ServeConfig
from lockserve.workers.actors import NODE_RESOURCE
from lockserve.workers.cp_actors import CpRank
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

RANK_NODE_SHARE = 0.01  # of a node's lockserve_node resource: a bundle lands on lockserve nodes only
CLOSE_TIMEOUT_S = 30.0


# ---- admission: which ranks hold which pages ----------------------------------------------------


class NoCapacity(ValueError):
    """No choice of ranks has the free pages a request needs."""


@dataclass(frozen=True)
class ShardRange:
    """Pages [first_page, first_page + num_pages) of a request on rank `index` (of the rank set)."""

    index: int
    first_page: int
    num_pages: int


def balance(total: int, floors: list[int], caps: list[int]) -> list[int] | None:
    """Sizes with floors[i] <= size <= caps[i] summing to total, the largest as small as the bounds
    allow (water filling); None when the bounds cannot sum to total."""
    if any(f > c for f, c in zip(floors, caps, strict=True)) or sum(floors) > total or sum(caps) < total:
        return None

    def filled(level: int) -> list[int]:
        return [min(max(level, f), c) for f, c in zip(floors, caps, strict=True)]

    lo, hi = 0, max(caps)
    while lo < hi:  # the lowest level whose fill reaches total
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(filled(mid)) >= total else (mid + 1, hi)
    sizes = filled(lo)
    surplus = sum(sizes) - total  # fewer than the sizes sitting at the level above their floor
    for i, size in enumerate(sizes):
        if surplus and size == lo and size > floors[i]:
            sizes[i] -= 1
            surplus -= 1
    return sizes


def plan_shards(free: Mapping[int, int], total_pages: int, tail_pages: int, sink_pages: int = 1,
                shards: int | None = None) -> list[ShardRange]:
    """The ranks of a request and their page ranges, in page order.

    free: rank index -> pages it can take now (alive ranks only); total_pages: the request's
    pages; tail_pages: pages from the one the first new token goes to, through the last (all on
    the last rank); sink_pages: the first rank holds at least these; shards: exactly this many
    ranks (None: the fewest that fit). Raises NoCapacity."""
    ranked = sorted(free, key=lambda i: (-free[i], i))
    for m in [shards] if shards is not None else range(1, len(ranked) + 1):
        if not 1 <= m <= len(ranked):
            continue
        chosen = ranked[:m]
        order = sorted(chosen[1:]) + [chosen[0]]  # the most free pages last: it takes every new token
        floors = [1] * m
        floors[0] = max(1, sink_pages)
        floors[-1] = max(floors[-1], tail_pages)
        sizes = balance(total_pages, floors, [free[i] for i in order])
        if sizes is not None:
            starts = [sum(sizes[:j]) for j in range(m)]
            return [ShardRange(i, s, n) for i, s, n in zip(order, starts, sizes, strict=True)]
    raise NoCapacity(f"no {shards or 'set of'} ranks hold {total_pages} pages ({tail_pages} on the last "
                     f"one); free pages by rank: {dict(sorted(free.items()))}")


# ---- the ranks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    """A rank as placed: its actor, node, address and KV capacity (pages)."""

    index: int
    actor: Any
    node_id: str
    address: str
    capacity_pages: int
    max_requests: int

    def where(self) -> str:
        return f"rank {self.index} on node {self.node_id} ({self.address})"


@dataclass
class RankSet:
    """The ranks' placement group (one bundle per rank), the node of each bundle, and the rank
    actors once started; close() kills them and frees the group."""

    group: Any
    bundle: dict[str, float] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)  # node id of each bundle
    ranks: list[RankInfo] = field(default_factory=list)
    actors: list = field(default_factory=list)

    def remaining(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        """The nodes with the GPUs and CPUs the bundles hold taken out (what workers can use)."""
        out = []
        for n in nodes:
            held = self.nodes.count(n.node_id)
            out.append(dataclasses.replace(n, gpus=n.gpus - held * int(self.bundle.get("GPU", 0)),
                                           cpus=n.cpus - held * int(self.bundle.get("CPU", 0))))
        return out

    def close(self) -> None:
        """Shut the ranks down (best effort: dead ones are skipped), kill them, free the group."""
        for ref in [a.shutdown.remote() for a in self.actors]:
            try:
                ray.get(ref, timeout=CLOSE_TIMEOUT_S)
            except Exception as err:  # a dead rank has nothing left to release
                log.warning("context-parallel rank shutdown failed: %s", err)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


def place_ranks(config: ServeConfig, cpu: bool, nodes: list[NodeInfo], timeout_s: float) -> RankSet:
    """Reserve a bundle per rank (1 CPU, and 1 GPU unless cpu) on the lockserve nodes: STRICT_SPREAD
    where there are enough nodes, else SPREAD. Placed before the workers, which get what is left
    (RankSet.remaining). ConfigError when the cluster cannot place them."""
    count = config.context_parallel.ranks
    bundle: dict[str, float] = {"CPU": 1.0} if cpu else {"CPU": 1.0, "GPU": 1.0}
    if any(n.marked for n in nodes):
        bundle[NODE_RESOURCE] = RANK_NODE_SHARE
    strategy = "STRICT_SPREAD" if count <= len(nodes) else "SPREAD"
    if strategy == "SPREAD":
        log.warning("context_parallel.ranks (%d) > lockserve nodes (%d): ranks share", count, len(nodes))
    ranks = RankSet(placement_group([dict(bundle) for _ in range(count)], strategy=strategy), bundle)
    ready, _ = ray.wait([ranks.group.ready()], timeout=timeout_s)
    if not ready:
        ranks.close()
        raise ConfigError(f"context_parallel.ranks ({count}) needs {count} bundles of {bundle} "
                          f"({strategy} over {len(nodes)} lockserve nodes); not placed within "
                          f"{timeout_s:.0f} s (see `ray status`)")
    table = placement_group_table(ranks.group)["bundles_to_node_id"]
    ranks.nodes = [table[i] for i in range(count)]
    return ranks


def start_ranks(ranks: RankSet, config: ServeConfig, namespace: str, cpu: bool, timeout_s: float) -> RankSet:
    """One CpRank actor per bundle of `ranks` (its node's page store must be running). ConfigError
    when a rank cannot start."""
    try:
        for i in range(len(ranks.nodes)):
            strategy = PlacementGroupSchedulingStrategy(ranks.group, placement_group_bundle_index=i)
            ranks.actors.append(CpRank.options(
                name=f"lockserve-cp-rank-{i}", namespace=namespace, num_cpus=1, num_gpus=0 if cpu else 1,
                max_restarts=0, scheduling_strategy=strategy).remote(config, f"cp-rank-{i}", namespace))
        for i, actor in enumerate(ranks.actors):
            d = _ready(actor, i, timeout_s)
            ranks.ranks.append(RankInfo(i, actor, d["node_id"], d["address"], d["capacity_pages"],
                                        d["max_requests"]))
        return ranks
    except BaseException:
        ranks.close()
        raise


def _ready(actor, index: int, timeout_s: float) -> dict:
    try:
        return ray.get(actor.describe.remote(), timeout=timeout_s)
    except GetTimeoutError:
        raise RuntimeError(f"context-parallel rank {index} did not start within {timeout_s:.0f} s") from None
    except RayActorError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        reason = lines[-1] if lines else err
        raise ConfigError(f"context-parallel rank {index} could not start: {reason}") from None
