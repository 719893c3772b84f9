"""The `ray up` files (configs/cluster-*.yaml): Ray's own cluster-config validation accepts them,
and every node starts Ray with token authentication, the lockserve_node resource and a dashboard
on loopback only. No cloud access: this checks the files, not a launch."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = ["cluster-local.yaml", "cluster-aws.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def ray_start_commands(config: dict, key: str) -> list[list[str]]:
    """Each `ray start` command of a start-command list, split into shell words."""
    starts = [shlex.split(c) for c in config[key] if re.search(r"\bray start\b", c)]
    assert starts, f"{key} has no `ray start` command"
    return starts


def flag(words: list[str], name: str) -> str | None:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    return values[-1] if values else None


@pytest.mark.parametrize("name", FILES)
def test_ray_accepts_the_cluster_file(name):
    config = load(name)
    validate_config(prepare_config(config))  # raises on a schema error (jsonschema) or bad node types


@pytest.mark.parametrize("name", FILES)
def test_every_node_starts_ray_with_auth_and_the_lockserve_resource(name):
    config = load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for words in ray_start_commands(config, key):
            assert "RAY_AUTH_MODE=token" in words, f"{key}: token authentication must be on: {words}"
            assert json.loads(flag(words, "resources")) == {"lockserve_node": 1}, f"{key}: {words}"
            assert "--disable-usage-stats" in words
    [head] = ray_start_commands(config, "head_start_ray_commands")
    assert "--head" in head and flag(head, "dashboard-host") == "127.0.0.1"
    assert flag(head, "autoscaling-config") == "~/ray_bootstrap_config.yaml"
    [worker] = ray_start_commands(config, "worker_start_ray_commands")
    assert flag(worker, "address") == "$RAY_HEAD_IP:6379" == f"$RAY_HEAD_IP:{flag(head, 'port')}"
    assert "0.0.0.0" not in (CONFIGS / name).read_text(), "nothing may bind every interface"


@pytest.mark.parametrize("name", FILES)
def test_nodes_get_the_project_and_the_token(name):
    config = load(name)
    assert config["file_mounts"] == {"~/lockserve": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert "cd ~/lockserve && bash scripts/install.sh" in config["setup_commands"]
    assert (CONFIGS.parent / "scripts" / "install.sh").is_file()
    assert ".gitignore" in config["rsync_filter"], "the local .venv must not be copied"


def test_local_file_has_placeholders_to_replace():
    provider = load("cluster-local.yaml")["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] == "HEAD_IP" and provider["worker_ips"] == ["WORKER_IP_1", "WORKER_IP_2"]


def test_aws_node_types_carry_the_resource_and_gpus():
    config = load("cluster-aws.yaml")
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert all(t["resources"].get("lockserve_node") == 1 for t in types.values())
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, "the AWS file must offer GPU nodes"
    assert all(re.match(r"(g\d|p\d)", t["node_config"]["InstanceType"]) for t in gpu_types.values())
    assert sum(t.get("min_workers", 0) for t in gpu_types.values()) >= 1, \
        "lockserve places workers on nodes that are up: at least one GPU node must start with the cluster"


def _allowed_ports(text: str) -> set[int]:
    rule = re.search(r"allow TCP ([0-9, \-and]+);", text)
    assert rule, "the file must say which TCP ports the nodes need open between them"
    ports: set[int] = set()
    for part in re.split(r",\s*|\s+and\s+", rule.group(1).strip()):
        low, _, high = part.partition("-")
        ports.update(range(int(low), int(high or low) + 1))
    return ports


def test_local_file_pins_rays_ports_inside_its_firewall_rule():
    text = (CONFIGS / "cluster-local.yaml").read_text()
    allowed, config = _allowed_ports(text), load("cluster-local.yaml")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for words in ray_start_commands(config, key):
            ports = [w.split("=") for w in words if re.match(r"--[\w-]*port=\d+$", w)]
            pinned = {name: int(value) for name, value in ports}
            assert {"--node-manager-port", "--object-manager-port", "--min-worker-port", "--max-worker-port",
                    "--runtime-env-agent-port", "--dashboard-agent-grpc-port"} <= set(pinned), (key, pinned)
            for flag_name, port in pinned.items():
                assert port in allowed, f"{key}: {flag_name}={port} is outside the firewall rule"
            assert set(range(pinned["--min-worker-port"], pinned["--max-worker-port"] + 1)) <= allowed
    assert 8265 not in allowed, "the dashboard/job port stays closed (reached through `ray dashboard`)"


def test_aws_file_starts_the_gpu_nodes_it_serves_with():
    config, text = load("cluster-aws.yaml"), (CONFIGS / "cluster-aws.yaml").read_text()
    gpu_types = {n: t for n, t in config["available_node_types"].items() if t["resources"].get("GPU")}
    assert sum(t["min_workers"] for t in gpu_types.values()) == 2, "two GPU nodes start with the cluster"
    assert all(t["min_workers"] <= t["max_workers"] for t in gpu_types.values())
    assert "does not ask the\n# autoscaler for more" in text and "adds as lockserve asks" not in text
