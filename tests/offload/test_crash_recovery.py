"""A page store SIGKILLed, not closed: in the middle of a spill (a manifest record half written) and in
the middle of a manifest compaction (the new log written aside, not yet renamed over the old one).

The store runs in a child process that acknowledges, after every call, which pages are on NVMe
(`PageStore.location`), then stops inside the operation under test (a patched write that signals the
parent and sleeps) and is SIGKILLed there. The parent reopens the directory: every acknowledged page
comes back (read against its manifest checksum: `verify_on_open`) with its exact bytes, the pages
whose spill was cut are reported missing, and neither the killed store's shared-memory segment nor a
manifest temp file is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.nvme import MANIFEST_NAME
from lockserve.offload.store import PageStore

from tests.offload.conftest import bits

REPO = Path(__file__).resolve().parents[2]
GEOMETRY = PageGeometry(16, 32, torch.float16)
HOST_SLOTS, MAX_PAGES = 4, 64

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import msgpack, torch
    from lockserve.offload import manifest
    from lockserve.offload.arena import PageGeometry
    from lockserve.offload.store import PageStore

    nvme_dir, shm_dir, prefix, mode = sys.argv[1:5]
    geometry = PageGeometry(16, 32, torch.float16)

    def stop_here(what):
        print(what, flush=True)  # the parent SIGKILLs us now
        time.sleep(600)

    def page(i):  # the bytes of page i: a function of its id alone
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn((1, *geometry.page_shape), generator=g).to(geometry.dtype)

    if mode == "spill":
        puts = {"n": 0}
        original = manifest.Manifest._append

        def torn_append(self, record):
            if record[0] == "put":
                puts["n"] += 1
                if puts["n"] == 4:  # the 4th spill: half its manifest record reaches the file
                    packed = msgpack.packb(record)
                    self._file.write(packed[: len(packed) // 2])
                    self._file.flush()
                    stop_here("TORN")
            original(self, record)

        manifest.Manifest._append = torn_append
        store = PageStore(geometry, 4, 64, nvme_dir=nvme_dir, shm_dir=shm_dir, prefix=prefix)
        print("SEGMENT", store.arena.name, flush=True)
        for i in range(40):  # one page at a time: from the 5th on, each allocation spills one
            ids, _ = store.allocate(1)
            store.write(ids, page(int(ids[0])))
            where = store.location(torch.arange(i + 1))
            print("ACK", json.dumps([p for p, w in enumerate(where) if w == "nvme"]), flush=True)
    else:  # "compact": reopen a directory with pages, stop between writing the new log and renaming it
        real_replace = os.replace

        def paused_replace(src, dst):
            if src.endswith(".tmp") and mode == "compact":
                stop_here("COMPACTING")
            real_replace(src, dst)

        manifest.os.replace = paused_replace
        store = PageStore(geometry, 4, 64, nvme_dir=nvme_dir, shm_dir=shm_dir, prefix=prefix)
    """
)


def page(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn((1, *GEOMETRY.page_shape), generator=g).to(GEOMETRY.dtype)


class Child:
    """The store process; `until(word)` reads its lines up to one starting with word."""

    def __init__(self, tmp_path: Path, prefix: str, mode: str):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        args = [str(tmp_path / "nvme"), str(tmp_path / "shm"), prefix, mode]
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def until(self, word: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise AssertionError(f"the store process exited ({code}): {self.proc.stderr.read()}")
            self.lines.append(line.strip())
            if line.startswith(word):
                return
        raise AssertionError(f"no {word!r} from the store process within {timeout_s} s: {self.lines}")

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def acknowledged(self) -> list[int]:
        acks = [json.loads(line[len("ACK "):]) for line in self.lines if line.startswith("ACK ")]
        return acks[-1] if acks else []


def reopen(tmp_path: Path, prefix: str) -> PageStore:
    return PageStore(GEOMETRY, HOST_SLOTS, MAX_PAGES, nvme_dir=str(tmp_path / "nvme"),
                     shm_dir=str(tmp_path / "shm"), prefix=prefix, verify_on_open=True)


def assert_nothing_left(tmp_path: Path) -> None:
    assert os.listdir(tmp_path / "shm") == [], "a shared-memory segment was left behind"
    temps = [n for n in os.listdir(tmp_path / "nvme") if n.endswith(".tmp")]
    assert temps == [], f"temporary files left behind: {temps}"


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "shm").mkdir()
    return tmp_path


def test_sigkill_mid_spill_recovers_every_acknowledged_page(dirs, prefix):
    child = Child(dirs, prefix, "spill")
    child.until("SEGMENT")
    segment = child.lines[-1].split()[1]
    child.until("TORN")  # stopped inside the 4th spill, its manifest record half written
    child.sigkill()
    acked = child.acknowledged()
    assert acked == [0, 1, 2], "three spills completed before the torn one"
    assert os.path.exists(dirs / "shm" / segment), "the killed store could not remove its segment"

    store = reopen(dirs, prefix)  # replays the manifest, drops the torn record, checks every crc
    try:
        recovered = store.recovered_ids().tolist()
        assert recovered == acked, f"recovered {recovered}, acknowledged {acked}: the rest is missing"
        expected = torch.cat([page(i) for i in acked])
        assert torch.equal(bits(store.read(torch.tensor(acked))), bits(expected))
        assert store.nvme.verify() == len(acked)
        assert not os.path.exists(dirs / "shm" / segment), "the next store removes a dead store's segment"
        for name in os.listdir(dirs / "nvme"):  # owner-only, as written by the killed store
            assert stat.S_IMODE(os.stat(dirs / "nvme" / name).st_mode) == 0o600, name
        assert stat.S_IMODE(os.stat(dirs / "nvme").st_mode) == 0o700
    finally:
        store.close()
    assert_nothing_left(dirs)


def test_sigkill_mid_compaction_loses_nothing(dirs, prefix):
    first = reopen(dirs, prefix)
    ids, _ = first.allocate(HOST_SLOTS)
    first.write(ids, torch.cat([page(int(i)) for i in ids]))
    more, _ = first.allocate(HOST_SLOTS)  # spills every page of `ids`
    first.write(more, torch.cat([page(int(i)) for i in more]))
    spilled = sorted(ids.tolist())
    first.close()
    log_before = (dirs / "nvme" / MANIFEST_NAME).read_bytes()

    child = Child(dirs, prefix, "compact")
    child.until("COMPACTING")  # the compacted log is in manifest.msgpack.tmp, not renamed yet
    assert (dirs / "nvme" / (MANIFEST_NAME + ".tmp")).exists()
    child.sigkill()
    assert (dirs / "nvme" / MANIFEST_NAME).read_bytes() == log_before, "the live log was never touched"

    store = reopen(dirs, prefix)
    try:
        assert store.recovered_ids().tolist() == spilled
        expected = torch.cat([page(i) for i in spilled])
        assert torch.equal(bits(store.read(torch.tensor(spilled))), bits(expected))
    finally:
        store.close()
    assert_nothing_left(dirs)
