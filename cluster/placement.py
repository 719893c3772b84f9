"""Where lockserve's actors go: which nodes it may use, and which node each GpuWorker gets.

Pure functions over the node list Ray reports (``ray.nodes()``), so the rules are tested without
a cluster. The ``lockserve_node`` custom resource (``NODE_RESOURCE``; the cluster files give every
node one) marks the nodes lockserve may use; a cluster where no node carries it (a cluster not
started from our files) lends every alive node. Bootstrap then pins each actor to its planned
node with a hard ``NodeAffinitySchedulingStrategy``, so the same rule works on a local instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lockserve.workers.actors import NODE_RESOURCE


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node: its id (hex), address, and the GPUs and CPUs it offers."""

    node_id: str
    address: str
    gpus: int
    cpus: int
    marked: bool  # carries NODE_RESOURCE


def node_infos(ray_nodes: Iterable[Mapping[str, Any]]) -> list[NodeInfo]:
    """Alive nodes from ``ray.nodes()`` entries, in the order Ray lists them."""
    infos = []
    for node in ray_nodes:
        if not node.get("Alive", False):
            continue
        resources = node.get("Resources", {})
        infos.append(NodeInfo(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", "?"),
            gpus=int(resources.get("GPU", 0)),
            cpus=int(resources.get("CPU", 0)),
            marked=resources.get(NODE_RESOURCE, 0) >= 1,
        ))
    return infos


def lockserve_nodes(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """The nodes that carry NODE_RESOURCE; every node when none does. ValueError when empty."""
    if not nodes:
        raise ValueError("the Ray cluster has no alive node")
    marked = [n for n in nodes if n.marked]
    return marked or list(nodes)


def plan_workers(nodes: list[NodeInfo], num_workers: int, cpu_only: bool) -> list[str]:
    """Node id of each GpuWorker (index = worker rank).

    GPU workers take one GPU each and fill nodes in order (ranks on one node stay together);
    CPU workers take one CPU each and spread round-robin over the nodes. Raises ValueError
    naming ray.num_gpu_workers when the nodes cannot hold that many.
    """
    if num_workers < 1:
        raise ValueError(f"ray.num_gpu_workers ({num_workers}) must be >= 1")
    kind, per_node = ("CPU", [n.cpus for n in nodes]) if cpu_only else ("GPU", [n.gpus for n in nodes])
    total = sum(per_node)
    if total < num_workers:
        hint = "" if cpu_only or total else "; set ray.cpu_only: true (or --cpu-only) to serve without GPUs"
        offered = ", ".join(f"{n.address}: {c}" for n, c in zip(nodes, per_node, strict=True))
        raise ValueError(f"ray.num_gpu_workers ({num_workers}) needs {num_workers} {kind}s, but the "
                         f"lockserve nodes offer {total} ({offered}){hint}")
    if not cpu_only:
        slots = [n.node_id for n, count in zip(nodes, per_node, strict=True) for _ in range(count)]
        return slots[:num_workers]
    plan, left = [], list(per_node)
    while len(plan) < num_workers:
        for i, node in enumerate(nodes):
            if left[i] > 0 and len(plan) < num_workers:
                plan.append(node.node_id)
                left[i] -= 1
    return plan


def worker_count(nodes: list[NodeInfo], requested: int | str, cpu_only: bool) -> int:
    """ray.num_gpu_workers resolved: a number as given; "auto" = one per GPU of the nodes, or one
    CPU worker when serving on CPUs."""
    if requested != "auto":
        return int(requested)
    return 1 if cpu_only else max(1, sum(n.gpus for n in nodes))


def gpus_short(nodes: list[NodeInfo], requested: int | str) -> bool:
    """True while the nodes offer fewer GPUs than ray.num_gpu_workers asks for ("auto": none)."""
    have = sum(n.gpus for n in nodes)
    return have < (1 if requested == "auto" else int(requested))


def workers_per_node(plan: list[str]) -> dict[str, int]:
    """How many planned workers share each node (they split its host memory)."""
    counts: dict[str, int] = {}
    for node_id in plan:
        counts[node_id] = counts.get(node_id, 0) + 1
    return counts
