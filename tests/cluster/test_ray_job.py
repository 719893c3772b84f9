"""`ray job submit -- lockserve serve` on a real Ray head started with `ray start` (subprocesses,
token authentication on, everything on 127.0.0.1): the served OpenAI API answers with the engine's
tokens, and `ray job stop` ends the server. The head runs in its own process group, which the
fixture ends by id (never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from lockserve.configs.schema import ServeConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import load_model

from tests.cluster.polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent  # ray and lockserve scripts of this environment
JOB_CONFIG = {
    "model": {"source": "preset:tiny", "device": "cpu", "dtype": "float32"},
    "cache": {"tier": "host", "budget_tokens": 64, "host_capacity_gib": 0.02, "hot_cache_pages": 64},
    "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 96, "prefill_chunk": 48},
    "server": {"host": "127.0.0.1", "log_level": "warning"},
    "ray": {"cpu_only": True, "num_gpu_workers": 1},
}


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen, so the kernel cannot
    hand the same port out twice (picking one at a time and closing it can, and Ray then refuses
    to start: "trying to use a port number ... that is used by other components")."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Head:
    """`ray start --head --block` in its own process group, with its own ports and temp dir."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="lsray")  # short: Ray's unix sockets live below it
        self.token = os.urandom(16).hex()
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.env.pop("RAY_ADDRESS", None)
        names = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
                 "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                 "node-manager-port", "object-manager-port", "serve-port")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.serve_port = ports.pop("serve-port")  # for the job's server, distinct from the head's
        self.dashboard = ports["dashboard-port"]
        self.address = f"http://127.0.0.1:{self.dashboard}"
        args = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--disable-usage-stats",
                "--num-cpus=2", f"--temp-dir={self.temp}", '--resources={"lockserve_node": 1}',
                *[f"--{name}={port}" for name, port in ports.items()]]
        self.log = open(os.path.join(self.temp, "ray-start.log"), "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"ray start exited ({self.proc.returncode}): {self.log_text()}")
        try:
            answer = httpx.get(f"{self.address}/api/version", timeout=2,
                               headers={"Authorization": f"Bearer {self.token}"})
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    def ray(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([str(BIN / "ray"), *args], env=self.env, capture_output=True, text=True,
                              timeout=120)
        if check and done.returncode != 0:
            command = " ".join(args)
            raise AssertionError(f"ray {command} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        """SIGTERM the head's process group (ray start --block stops its node), then SIGKILL."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=3)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers of the group that outlived the node
        except ProcessLookupError:
            pass
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    head = Head()
    try:
        wait_until(head.ready, 120, "the Ray head (dashboard, job server) was not up", poll_s=0.5)
        yield head
    finally:
        head.stop()


def reference_text(prompt_ids: list[int], max_tokens: int) -> str:
    config = ServeConfig(**JOB_CONFIG)
    model, tokenizer = load_model("preset:tiny", device="cpu", dtype=torch.float32)
    engine = Engine(model, tokenizer, config.cache, config.scheduler, "cpu", max_pages=64)
    engine.add_request("ref", prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.close()
    return "".join(o.text for o in outs)


NO_AGENT = "No available agent to submit job"  # Ray's answer while the head's job agent registers


def submit_when_an_agent_is_up(head: Head, *args: str, timeout_s: float = 90) -> None:
    """`ray job submit ARGS`, again while Ray answers that no agent can take a job yet: the head's
    dashboard agent registers a few seconds after the dashboard itself answers (`Head.ready`).
    Any other failure fails at once."""
    def attempt() -> bool:
        try:
            head.ray("job", "submit", *args)
        except AssertionError as err:
            if NO_AGENT not in str(err):
                raise
            return False
        return True

    wait_until(attempt, timeout_s, f"ray job submit past {NO_AGENT!r}", poll_s=2.0)


def test_job_submit_serves_the_openai_api(head, tmp_path):
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "serve-test.yaml").write_text(yaml.safe_dump(JOB_CONFIG))
    port = head.serve_port
    submission = f"lockserve-test-{os.getpid()}"
    submit_when_an_agent_is_up(head, f"--address={head.address}", f"--submission-id={submission}",
                               f"--working-dir={workdir}", "--no-wait", "--",
                               "lockserve", "serve", "--config", "serve-test.yaml", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url, head, submission), 240, "lockserve serve (the job) was not healthy",
                   poll_s=0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        completion = client.completions.create(model=model.id, prompt="Ray jobs!", max_tokens=5,
                                               temperature=0)
        assert completion.choices[0].text == reference_text([256, *b"Ray jobs!"], 5)
        assert completion.usage.prompt_tokens == 10
    finally:
        head.ray("job", "stop", f"--address={head.address}", submission, check=False)
    status = wait_until(lambda: _terminal_status(head, submission), 120, "the job did not stop", poll_s=0.5)
    assert status == "STOPPED"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def _healthy(url: str, head: Head, submission: str) -> bool:
    status = _terminal_status(head, submission)
    if status:
        logs = head.ray("job", "logs", f"--address={head.address}", submission, check=False)
        raise AssertionError(f"the job ended ({status}) before serving:\n{logs[-4000:]}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _terminal_status(head: Head, submission: str) -> str | None:
    answer = httpx.get(f"{head.address}/api/jobs/{submission}", timeout=10,
                       headers={"Authorization": f"Bearer {head.token}"})
    status = json.loads(answer.text).get("status") if answer.status_code == 200 else None
    return status if status in ("STOPPED", "SUCCEEDED", "FAILED") else None
