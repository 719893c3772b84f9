"""Cached prefixes across an engine's SIGKILL (tier host+nvme, tiny preset, CPU, real files).

An engine in a child process prefills documents and is SIGKILLed: mid-decode right after a
document's prefill was cached, in the middle of writing a segment of the prefix store, and in the
middle of appending its index record. A new engine with the same nvme_dir then serves requests
that share the documents: every page whose segment and record were complete is found (cached
tokens: all of the document's full pages) and gives a cold request's greedy tokens; a document
whose save was cut is prefilled cold (cached 0) and gives the same tokens; no segment file the
index does not name is left, and the killed engine's shared-memory segment is removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import torch
from lockserve.offload.host import DEFAULT_SHM_DIR
from lockserve.offload.prefix_store import INDEX_SUFFIX, SEGMENT_INFIX
from lockserve.workers.engine.prefix_cache import chain_hashes

from tests.workers.engine.test_engine import greedy, make_engine, run

REPO = Path(__file__).resolve().parents[3]
PAGE = 16
_G = torch.Generator().manual_seed(11)
DOC_A, DOC_B = (torch.randint(0, 256, (300,), generator=_G).tolist() for _ in range(2))
Q1, Q2 = (torch.randint(0, 256, (21,), generator=_G).tolist() for _ in range(2))
ENGINE = {"tier": "host+nvme", "budget_tokens": 64}  # 4 pages: 321-token prompts are pruned
# A host arena whose pin budget (half of it) holds a document's 20 pages: its save is one segment.
ONE_SEGMENT = {"host_capacity_gib": 48 * 6 * 4096 / 2**30}  # 48 ids of 6 slots (3 layers x 2 heads)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CHILD = textwrap.dedent(
    """
    import sys, time, msgpack, torch
    from pathlib import Path
    from lockserve.offload import prefix_store
    from lockserve.workers.model.presets import build_preset
    from tests.workers.engine.test_engine import greedy, make_engine
    from tests.workers.engine.test_prefix_restart import DOC_A, DOC_B, ENGINE, ONE_SEGMENT, Q1

    tmp, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)

    def stop_here(what):
        print(what, flush=True)  # the parent SIGKILLs us now
        time.sleep(600)

    if mode == "torn-segment":  # the second segment: half of its bytes reach the file
        def half_write(fd, offset, part, real=prefix_store.PrefixStore._write_part):
            if fd_seen.setdefault("n", 0) == 1:
                real(fd, offset, part[: part.shape[0] // 2])
                stop_here("TORN")
            fd_seen["n"] += 1
            real(fd, offset, part)
        fd_seen = {}
        prefix_store.PrefixStore._write_part = staticmethod(half_write)
    if mode == "torn-index":  # the second segment is written, half of its record reaches the index
        def half_append(self, record, real=prefix_store.PrefixStore._append):
            if record[0] == "seg" and self.num_pages:
                packed = msgpack.packb(record)
                self._index.write(packed[: len(packed) // 2])
                self._index.flush()
                stop_here("TORN")
            real(self, record)
        prefix_store.PrefixStore._append = half_append

    engine = make_engine(build_preset("tiny", seed=0, device="cpu"), tmp, **ENGINE, **ONE_SEGMENT)
    print("SEGMENT", engine.kv.settled.store.arena.name, flush=True)
    for rid, doc in (("a", DOC_A), ("b", DOC_B)):
        # 2 tokens: no page fills while decoding, so b's prompt is the second segment saved
        engine.add_request(rid, doc + Q1, greedy(40 if mode == "save" else 2))
        while not engine.scheduler.find(rid).output_ids:  # until its prefill is done (and cached)
            engine.step()
        assert engine.prefix_disk.drain(), "the writer saves in the background: wait for it"
        print("SAVED", rid, engine.stats()["prefix_disk_pages"], flush=True)
        if mode == "save":
            engine.step()
            stop_here("DECODING")  # killed mid-request, its pages never released
        while engine.has_unfinished():
            engine.step()
    stop_here("DONE")
    """
)


class Child:
    """The engine process; `until(word)` reads its lines up to one starting with word."""

    def __init__(self, tmp_path: Path, mode: str):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), mode], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def until(self, word: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise AssertionError(f"the engine process exited ({code}): {self.proc.stderr.read()[-4000:]}")
            self.lines.append(line.strip())
            if line.startswith(word):
                return line.strip()
        raise AssertionError(f"no {word!r} from the engine process within {timeout_s} s: {self.lines}")

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL, "the engine process must die by SIGKILL"


@pytest.fixture(scope="module")
def tiny():
    from lockserve.workers.model.presets import build_preset

    return build_preset("tiny", seed=0, device="cpu")


@pytest.fixture(scope="module")
def cold_tokens(tiny, tmp_path_factory):
    """Greedy tokens of each request the tests send, from an engine without prefix reuse."""
    engine = make_engine(tiny, tmp_path_factory.mktemp("cold"), prefix_reuse=False, **ENGINE)
    want = run(engine, {"a2": (DOC_A + Q2, greedy()), "b2": (DOC_B + Q2, greedy())})
    engine.close()
    return want


def serve(engine, rid: str, ids: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request served alone."""
    engine.add_request(rid, ids, greedy())
    got, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            got += out.token_ids
            cached = out.num_cached_tokens
    return got, cached


def store_name(tmp_path: Path) -> str:
    """The prefix store's name in nvme_dir (one engine config: one salt)."""
    (index,) = (p.name for p in (tmp_path / "nvme").iterdir() if p.name.endswith(INDEX_SUFFIX))
    return index.removesuffix(INDEX_SUFFIX)


def indexed_segments(tmp_path: Path) -> set[str]:
    """Numbers of the segment files the index on disk names, read here from the format (a header,
    then "seg" and "drop" records; a torn tail is not a record)."""
    name = store_name(tmp_path)
    names: set[str] = set()
    with open(tmp_path / "nvme" / (name + INDEX_SUFFIX), "rb") as f:
        records = list(msgpack.Unpacker(f, raw=False))
    for record in records[1:]:
        if record[0] == "seg":
            names.add(record[1])
        else:
            names -= set(record[1])
    return {n.removeprefix(name + SEGMENT_INFIX) for n in names}


def segment_files(tmp_path: Path) -> set[str]:
    """Numbers of the segment files on disk."""
    prefix = store_name(tmp_path) + SEGMENT_INFIX
    return {p.name.removeprefix(prefix) for p in (tmp_path / "nvme").iterdir() if p.name.startswith(prefix)}


@pytest.mark.parametrize("mode", ["save", "torn-segment", "torn-index"])
def test_prefixes_survive_sigkill(tiny, cold_tokens, tmp_path, mode):
    child = Child(tmp_path, mode)
    segment = child.until("SEGMENT").split()[1]
    saved = child.until("SAVED a")
    assert saved.split()[2] == str(len(DOC_A + Q1) // PAGE), f"document a's prompt pages persisted: {saved}"
    child.until("DECODING" if mode == "save" else "TORN")
    child.sigkill()
    assert indexed_segments(tmp_path) == {"00000000.bin"}, f"{mode}: only a's segment is indexed"
    torn = {"save": set(), "torn-segment": {"00000001.bin"}, "torn-index": {"00000001.bin"}}[mode]
    assert segment_files(tmp_path) == {"00000000.bin"} | torn, f"{mode}: {segment_files(tmp_path)}"

    engine = make_engine(tiny, tmp_path, **ENGINE, **ONE_SEGMENT)  # the same nvme_dir
    try:
        assert not os.path.exists(os.path.join(DEFAULT_SHM_DIR, segment)), "the killed engine's arena is gone"
        got, cached = serve(engine, "a2", DOC_A + Q2)
        assert cached == len(DOC_A) // PAGE * PAGE, f"{mode}: a found after a restart ({cached} cached)"
        assert got == cold_tokens["a2"], f"{mode}: a warm request after the restart gives a cold one's tokens"
        got, cached = serve(engine, "b2", DOC_B + Q2)
        assert cached == 0, f"{mode}: b's save was cut, none of its pages may be found ({cached} cached)"
        assert got == cold_tokens["b2"], f"{mode}: document b prefilled cold gives a cold one's tokens"
        assert engine.prefix_disk.drain(), "the saves queued by a2 and b2"
        stats = engine.stats()
        assert stats["prefix_disk_restored_pages"] == len(DOC_A) // PAGE, stats
        # a's prompt (20 pages), a2's question pages after the document (2), b2's prompt (20)
        assert stats["prefix_disk_pages"] == 20 + 2 + 20, stats
    finally:
        engine.close()
    indexed = indexed_segments(tmp_path)
    assert segment_files(tmp_path) == indexed and len(indexed) == 3, \
        f"{mode}: every segment file is indexed (the cut one was removed): {segment_files(tmp_path)}"


def test_restored_pages_are_the_cached_pages_bitwise(tiny, tmp_path):
    """A restarted engine's restored page ids hold the K/V and summaries the first engine cached,
    byte for byte (summaries persisted, not rebuilt)."""
    first = make_engine(tiny, tmp_path, **ENGINE)
    run(first, {"a": (DOC_A + Q1, greedy(2))})
    pids = first.prefix.match(chain_hashes(DOC_A, PAGE, first.prefix.salt))
    assert len(pids) == 18, pids
    kv_before = first.kv.read_tokens("", pids, 18 * PAGE)
    rows_before = first.kv.summaries.page_rows(torch.tensor(pids))
    first.close()

    again = make_engine(tiny, tmp_path, **ENGINE)
    try:
        again.add_request("a2", DOC_A + Q2, greedy(1))
        again.step()  # admitted: pages restored
        seq = again.scheduler.find("a2")
        assert seq.num_cached == 18 * PAGE, seq.num_cached
        restored = seq.pids[:18]
        kv_after = again.kv.read_tokens("", restored, 18 * PAGE)
        assert torch.equal(kv_after.view(torch.uint8), kv_before.view(torch.uint8)), "K/V restored bitwise"
        rows_after = again.kv.summaries.page_rows(torch.tensor(restored))
        for name, want in rows_before.items():
            assert torch.equal(rows_after[name], want), f"summary field {name} restored bitwise"
    finally:
        again.close()


def test_prefix_nvme_gib_zero_keeps_nothing(tiny, tmp_path):
    first = make_engine(tiny, tmp_path, prefix_nvme_gib=0, **ENGINE)
    run(first, {"a": (DOC_A + Q1, greedy(2))})
    first.close()
    names = [p.name for p in (tmp_path / "nvme").iterdir()]
    assert first.prefix_disk is None and not any(n.startswith("prefix") for n in names), names
    again = make_engine(tiny, tmp_path, prefix_nvme_gib=0, **ENGINE)
    try:
        assert serve(again, "a2", DOC_A + Q2)[1] == 0, "a restart finds nothing"
    finally:
        again.close()


def test_a_restart_frees_the_pages_the_engine_before_it_spilled(tiny, cold_tokens, tmp_path):
    """The first engine's cached pages spilled to NVMe (its host arena holds a few ids) and stay in
    the spill tier's manifest after it closes. The restarted engine frees them as it opens (its
    persisted prefixes come back from the prefix store into new ids): with page ids for little more
    than one document, restoring the document must not run out of them."""
    small = {"max_pages": 28, **ENGINE}  # a document takes 21 ids: it and what spilled do not fit
    first = make_engine(tiny, tmp_path, **small)
    run(first, {"a": (DOC_A + Q1, greedy(2))})
    assert first.prefix_disk.drain(), "the writer saves in the background: wait for it"
    assert first.stats()["nvme_spilled_pages"] > 0, "the document's pages must spill for this test"
    first.close()

    again = make_engine(tiny, tmp_path, **small)
    try:
        freed = again.recovered_pages
        assert freed["pages"] > 0, "the spilled pages the first engine left are found and freed"
        assert freed["bytes"] == freed["pages"] * again.kv.settled.store.geometry.slot_bytes, freed
        assert again.kv.settled.store.nvme.bytes_read == 0, "freed unread: no checksum pass over them"
        got, cached = serve(again, "a2", DOC_A + Q2)
        assert cached == len(DOC_A) // PAGE * PAGE, f"the document is found after the restart ({cached})"
        assert got == cold_tokens["a2"], "and gives a cold request's tokens"
    finally:
        again.close()


def test_saved_pages_spill_without_a_second_write(tiny, cold_tokens, tmp_path):
    """A host arena of 30 ids: document a's pages spill while b is prefilled. With
    cache.nvme_saved_spills (the default) a page whose record is written spills without a write of
    its own and is read back from the record: the spill tier writes fewer pages than with it off,
    the tokens are a cold request's either way, and a restarted engine's restored pages spill the
    same way."""
    small = {"host_capacity_gib": 30 * 6 * 4096 / 2**30, **ENGINE}
    written, got = {}, {}
    for saved in (True, False):
        engine = make_engine(tiny, tmp_path / str(saved), nvme_saved_spills=saved, **small)
        try:
            for rid, doc in (("a", DOC_A), ("b", DOC_B)):
                serve(engine, rid, doc + Q1)
                assert engine.prefix_disk.drain(), "the writer saves in the background: wait for it"
            got[saved], cached = serve(engine, "a2", DOC_A + Q2)
            assert cached == len(DOC_A) // PAGE * PAGE, cached
            stats = engine.stats()
            assert (stats["nvme_saved_spilled_pages"] > 0) == saved, stats
            assert (stats["nvme_saved_read_pages"] > 0) == saved, stats
            written[saved] = engine.kv.settled.store.nvme.bytes_written
        finally:
            engine.close()
    assert got[True] == got[False] == cold_tokens["a2"]
    assert written[True] < written[False] / 2, written

    again = make_engine(tiny, tmp_path / "True", **small)
    try:
        tokens, cached = serve(again, "b2", DOC_B + Q2)
        assert cached == len(DOC_B) // PAGE * PAGE and tokens == cold_tokens["b2"], cached
        serve(again, "a2", DOC_A + Q2)  # restored into the arena that b's restored pages fill
        assert again.stats()["nvme_saved_spilled_pages"] > 0, "restored pages spill without a write"
    finally:
        again.close()
