"""Placement rules (cluster/placement.py) on node lists shaped like ray.nodes(); no cluster."""

from __future__ import annotations

import pytest
from lockserve.cluster.placement import lockserve_nodes, node_infos, plan_workers, workers_per_node


def ray_node(node_id: str, gpus: int = 0, cpus: int = 4, marked: bool = True, alive: bool = True) -> dict:
    resources = {"CPU": float(cpus), "memory": 1e9, f"node:10.0.0.{len(node_id)}": 1.0}
    if gpus:
        resources["GPU"] = float(gpus)
    if marked:
        resources["lockserve_node"] = 1.0
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"host-{node_id}",
            "Resources": resources}


def test_only_alive_marked_nodes_are_used():
    listed = [ray_node("a", marked=False), ray_node("b"), ray_node("c", alive=False), ray_node("d")]
    nodes = node_infos(listed)
    assert [n.node_id for n in nodes] == ["a", "b", "d"]
    assert [n.node_id for n in lockserve_nodes(nodes)] == ["b", "d"]


def test_unmarked_cluster_lends_every_node():
    nodes = node_infos([ray_node("a", marked=False), ray_node("b", marked=False)])
    assert [n.node_id for n in lockserve_nodes(nodes)] == ["a", "b"]
    with pytest.raises(ValueError, match="no alive node"):
        lockserve_nodes(node_infos([ray_node("x", alive=False)]))


def test_gpu_workers_fill_nodes_in_order():
    nodes = node_infos([ray_node("a", gpus=2), ray_node("b", gpus=0), ray_node("c", gpus=3)])
    assert plan_workers(nodes, 4, cpu_only=False) == ["a", "a", "c", "c"]
    assert plan_workers(nodes, 5, cpu_only=False) == ["a", "a", "c", "c", "c"]
    assert workers_per_node(plan_workers(nodes, 3, cpu_only=False)) == {"a": 2, "c": 1}


def test_cpu_workers_spread_round_robin_within_cpus():
    nodes = node_infos([ray_node("a", cpus=1), ray_node("b", cpus=3), ray_node("c", cpus=2)])
    assert plan_workers(nodes, 3, cpu_only=True) == ["a", "b", "c"]
    assert plan_workers(nodes, 6, cpu_only=True) == ["a", "b", "c", "b", "c", "b"]


def test_too_many_workers_is_an_error_naming_the_field():
    nodes = node_infos([ray_node("a", gpus=1), ray_node("b", gpus=1)])
    with pytest.raises(ValueError, match=r"ray.num_gpu_workers \(3\) needs 3 GPUs, .* offer 2 "
                                         r"\(host-a: 1, host-b: 1\)$"):
        plan_workers(nodes, 3, cpu_only=False)
    cpu_box = node_infos([ray_node("a", cpus=2)])
    with pytest.raises(ValueError, match=r"offer 0 .*set ray.cpu_only: true"):
        plan_workers(cpu_box, 1, cpu_only=False)
    with pytest.raises(ValueError, match=r"ray.num_gpu_workers \(0\) must be >= 1"):
        plan_workers(cpu_box, 0, cpu_only=True)


def test_cpu_workers_when_asked_or_when_auto_finds_no_gpu():
    """The embedded default serves on a machine without a GPU; model.device cuda insists on one."""
    from lockserve.cluster.bootstrap import use_cpu_workers
    from lockserve.cluster.placement import NodeInfo
    from lockserve.configs import load_config

    cpu_node = [NodeInfo("a", "127.0.0.1", gpus=0, cpus=2, marked=True)]
    gpu_node = [NodeInfo("b", "127.0.0.1", gpus=1, cpus=16, marked=True)]
    auto = load_config(None)
    assert auto.model.device == "auto" and not auto.ray.cpu_only
    assert use_cpu_workers(auto, cpu_node), "auto with no GPU anywhere -> CPU workers"
    assert not use_cpu_workers(auto, gpu_node), "auto with a GPU -> GPU workers"
    cuda = load_config(None, {"model.device": "cuda"})
    assert not use_cpu_workers(cuda, cpu_node), "device cuda never falls back to CPU"
    assert use_cpu_workers(load_config(None, {"ray.cpu_only": True}), gpu_node)
    assert use_cpu_workers(load_config(None, {"model.device": "cpu"}), gpu_node)


def test_auto_worker_count_is_one_per_gpu_or_one_cpu_worker():
    from lockserve.cluster.placement import gpus_short, worker_count

    nodes = node_infos([ray_node("a", gpus=2), ray_node("b", gpus=1)])
    assert worker_count(nodes, "auto", cpu_only=False) == 3 and worker_count(nodes, 2, cpu_only=False) == 2
    assert worker_count(node_infos([ray_node("c")]), "auto", cpu_only=True) == 1
    assert not gpus_short(nodes, "auto") and not gpus_short(nodes, 3) and gpus_short(nodes, 4)
    assert gpus_short(node_infos([ray_node("c")]), "auto"), "auto wants at least one GPU"


def test_on_a_cluster_auto_waits_for_gpu_nodes_and_never_serves_on_the_cpu_head(monkeypatch, capsys):
    """A job submitted before the GPU nodes joined: it waits for them; if none comes, one line."""
    from lockserve.cluster import bootstrap
    from lockserve.configs import ConfigError, load_config

    head = ray_node("head", gpus=0)
    listings = iter([[head], [head], [head, ray_node("gpu-1", gpus=1)],
                     [head, ray_node("gpu-1", gpus=1), ray_node("gpu-2", gpus=1)]])
    monkeypatch.setattr(bootstrap.ray, "nodes", lambda: next(listings))
    monkeypatch.setattr(bootstrap.time, "sleep", lambda s: None)
    config = load_config(None, {"ray.num_gpu_workers": 2})
    nodes = bootstrap.wait_for_gpus(config)
    assert sum(n.gpus for n in nodes) == 2, "waited until both GPU nodes joined"
    assert "waiting for GPU nodes to join" in capsys.readouterr().err
    assert not bootstrap.use_cpu_workers(config, nodes, local=False)

    monkeypatch.setattr(bootstrap.ray, "nodes", lambda: [head])
    never = load_config(None, {"ray.wait_for_gpus_s": 0})
    nodes = bootstrap.wait_for_gpus(never)
    expected = (r"no GPU on the cluster's lockserve nodes \(host-head: 0 GPU, 4 CPU\) after waiting "
                r"ray.wait_for_gpus_s \(0 s\).*model.device: cpu")
    with pytest.raises(ConfigError, match=expected):
        bootstrap.use_cpu_workers(never, nodes, local=False)
    assert bootstrap.use_cpu_workers(never, nodes, local=True), "a local instance (a laptop) serves on CPU"
