"""The actors' bodies without a Ray cluster: NodeStore regions in real shared memory, the
admission limits against the real Engine, and EngineWorker's loop and streams on the tiny model.
(tests/cluster/test_ray_*.py run the same classes as Ray actors.)"""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig, ServeConfig
from lockserve.offload.arena import PageGeometry
from lockserve.offload.host import HostArena
from lockserve.workers.actors import EngineWorker, NodeStore
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.kv_manager import kv_pages
from lockserve.workers.engine.request import RequestOptions, TokenEvent
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import load_model

GEOMETRY = PageGeometry(16, 32, torch.float32)  # 4 KiB slots


@pytest.fixture
def store(tmp_path):
    s = NodeStore(capacity_bytes=100 * GEOMETRY.slot_bytes, nvme_dir=str(tmp_path / "nvme"),
                  shm_dir=str(tmp_path))
    yield s
    s.shutdown()


# ---- NodeStore ----------------------------------------------------------------------------------


def test_region_is_one_shared_segment_per_key(store, tmp_path):
    spec = store.region("worker-0", GEOMETRY.to_dict(), 37)
    again = store.region("worker-0", GEOMETRY.to_dict(), 37)
    other = store.region("worker-1", GEOMETRY.to_dict(), 21)
    assert again == spec, "asking again for a key (a restarted worker) must give the same segment"
    assert other.name != spec.name
    writer, reader = HostArena.attach_spec(spec), HostArena.attach_spec(again)
    pages = torch.randn(3, *GEOMETRY.page_shape)  # [3, 2, B, d]
    writer.write(torch.tensor([0, 17, 36]), pages)
    assert torch.equal(reader.read(torch.tensor([0, 17, 36])), pages), "the two attachments share memory"
    assert store.describe()["bytes_reserved"] == (37 + 21) * GEOMETRY.slot_bytes
    writer.close()
    reader.close()
    assert os.path.exists(tmp_path / spec.name), "a worker detaching must not remove the store's segment"


def test_region_refuses_a_different_shape_and_overcommit(store):
    store.region("worker-0", GEOMETRY.to_dict(), 60)
    with pytest.raises(ValueError, match=r"region 'worker-0' exists with 60 slots"):
        store.region("worker-0", GEOMETRY.to_dict(), 61)
    with pytest.raises(ValueError, match=r"region 'worker-1' needs 167936 bytes .* has 163840 left"):
        store.region("worker-1", GEOMETRY.to_dict(), 41)
    store.region("worker-1", GEOMETRY.to_dict(), 40)  # exactly the rest fits


def test_free_and_shutdown_unlink_segments(store, tmp_path):
    a = store.region("worker-0", GEOMETRY.to_dict(), 5)
    b = store.region("worker-1", GEOMETRY.to_dict(), 5)
    assert store.free_region("worker-0") and not store.free_region("worker-0")
    assert not os.path.exists(tmp_path / a.name) and os.path.exists(tmp_path / b.name)
    store.shutdown()
    store.shutdown()
    assert not os.path.exists(tmp_path / b.name)
    assert store.describe()["regions"] == {}


def test_nvme_dir_per_worker(store, tmp_path):
    path = store.nvme_dir_for("worker-3")
    assert path == str(tmp_path / "nvme" / "worker-3") and os.path.isdir(path)
    assert os.stat(path).st_mode & 0o777 == 0o700, "spilled KV pages are the owner's alone"
    with pytest.raises(ValueError, match="cache.nvme_dir is not set"):
        NodeStore(1 << 20).nvme_dir_for("worker-0")
    with pytest.raises(ValueError, match=r"capacity_bytes \(0\) must be > 0"):
        NodeStore(0)


# ---- admission limits and sizing vs the real Engine ---------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_model("preset:tiny", device="cpu", dtype=torch.float32)


def _engine(tiny, tier: str, attention: str, max_pages: int | None = 12, **cache) -> Engine:
    model, tokenizer = tiny
    config = CacheConfig(tier=tier, attention=attention, budget_tokens=64, hot_cache_pages=0, **cache)
    return Engine(model, tokenizer, config, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                                            prefill_chunk=32), "cpu",
                  max_pages=max_pages, max_model_len=160)


ADMISSION_CASES = [  # (prompt tokens, max_tokens, options)
    (1, 1, {}), (10, 150, {}), (10, 151, {}), (100, 93, {}), (100, 60, {}), (0, 4, {}),
    (5, 4, {"budget_tokens": 48}), (5, 4, {"budget_tokens": 49}), (5, 4, {"budget_tokens": 65}),
    (5, 4, {"budget_tokens": 1024}), (5, 4, {"tier": "hbm"}), (5, 4, {"tier": "host"}),
    (5, 4, {"attention": "dense"}), (5, 4, {"attention": "locks", "budget_tokens": 80}),
]


@pytest.mark.parametrize("tier,attention", [("hbm", "locks"), ("host", "locks"), ("host", "dense"),
                                            ("hbm", "dense")])
def test_limits_check_agrees_with_engine_admission(tiny, tier, attention):
    engine = _engine(tiny, tier, attention)
    limits = engine.limits
    try:
        for i, (prompt, max_tokens, options) in enumerate(ADMISSION_CASES):
            case = f"{tier}/{attention} prompt={prompt} max_tokens={max_tokens} options={options}"
            params, opts = SamplingParams(max_tokens=max_tokens), RequestOptions(**options)
            expected = _outcome(engine.add_request, f"r{i}", [7] * prompt, params, opts)
            engine.abort(f"r{i}")
            got = _outcome(limits.check, prompt, max_tokens, **options)
            assert got == expected, f"{case}: limits say {got!r}, the engine says {expected!r}"
    finally:
        engine.close()
    outcomes = {_outcome(limits.check, p, m, **o) for p, m, o in ADMISSION_CASES}
    assert len(outcomes) >= 3, "the cases must exercise both acceptance and several refusals"


def _outcome(call, *args, **kwargs) -> str:
    try:
        call(*args, **kwargs)
    except ValueError as err:
        return str(err)
    return "ok"


@pytest.mark.parametrize("tier,cache,gib", [("host", {"host_capacity_gib": 0.01}, 0.01), ("hbm", {}, 8.0),
                                             ("host+nvme", {"host_capacity_gib": 0.002,
                                                            "nvme_capacity_gib": 0.003}, 0.005)])
def test_kv_pages_is_the_capacity_over_a_page_id(tiny, tier, cache, gib, tmp_path):
    """The KV page ids a worker sizes its engine with: host capacity (+ NVMe on host+nvme) over the
    bytes of one page id, capped at max_num_seqs x max_model_len; the engine's default is the same."""
    model = tiny[0]
    cache = {**cache, "nvme_dir": str(tmp_path)} if tier == "host+nvme" else cache
    config = CacheConfig(tier=tier, **cache)
    mc = model.config
    per_id = mc.num_layers * mc.num_kv_heads * 2 * 16 * mc.head_dim * model.dtype.itemsize
    assert kv_pages(mc, config, 1000, 16000, model.dtype) == min(int(gib * 2**30) // per_id, 1000 * 1000)
    assert kv_pages(mc, config, 2, 160, model.dtype) == 20  # capped: 2 sequences of 10 pages
    engine = _engine(tiny, tier, "locks", max_pages=None, **cache)
    assert engine.kv.layout.max_pages == kv_pages(mc, engine.cache_config, 2, 160, model.dtype)
    engine.close()
    with pytest.raises(ValueError, match=r"KV capacity \(1e-06 GiB: cache.host_capacity_gib\) holds no"):
        kv_pages(mc, CacheConfig(tier="host", host_capacity_gib=1e-6), 2, 160, model.dtype)


# ---- EngineWorker: the loop and the streams -----------------------------------------------------


def _config() -> ServeConfig:
    return ServeConfig(
        model={"source": "preset:tiny", "device": "cpu", "dtype": "float32"},
        cache={"tier": "host", "budget_tokens": 64, "host_capacity_gib": 0.01, "hot_cache_pages": 64},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 96, "prefill_chunk": 48},
        ray={"cpu_only": True})


@functools.cache
def reference_tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of the in-process Engine alone (no loop, no actor), config `_config()`."""
    config = _config()
    model, tokenizer = load_model(config.model.source, device="cpu", dtype=torch.float32)
    engine = Engine(model, tokenizer, config.cache, config.scheduler, "cpu", max_pages=64)
    engine.add_request("ref", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    engine.close()
    return tokens


@pytest.fixture(scope="module")
def worker():
    w = EngineWorker(_config(), "worker-0")
    yield w
    w.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
LONG = SamplingParams(temperature=0.0, max_tokens=200)
PROMPT = list(range(40, 77))  # 37 tokens: two full pages and an open one


async def _collect(worker: EngineWorker, rid: str, prompt: list[int], params=None, options=None) -> list:
    return [ev async for ev in worker.generate(rid, prompt, params or GREEDY, options or RequestOptions())]


def test_worker_streams_the_engine_tokens(worker):
    events = asyncio.run(_collect(worker, "a", PROMPT))
    assert all(isinstance(e, TokenEvent) for e in events), "the one event type crosses Ray"
    assert [t for e in events for t in e.token_ids] == reference_tokens(tuple(PROMPT), 5)
    assert len(events) == len([t for e in events for t in e.token_ids]), "one event per decode step"
    assert [e.finish_reason for e in events][:-1] == [None] * (len(events) - 1)
    assert events[-1].prompt_tokens == 37 and events[-1].completion_tokens == len(events)
    assert worker.health()["arena"] is not None, "tier host without a store: the engine's own arena"


def test_worker_rejects_bad_input_with_the_field():
    w = EngineWorker(_config(), "worker-x")
    try:
        with pytest.raises(ValueError, match=r"prompt_ids\[1\] \(999\) must be a token id"):
            asyncio.run(_collect(w, "bad", [5, 999]))
        with pytest.raises(TypeError, match=r"params \(dict\) and options \(RequestOptions\) must be"):
            asyncio.run(_collect(w, "bad", [5], {"max_tokens": 4}))
        with pytest.raises(ValueError, match=r"budget_tokens \(1024\) exceeds"):
            w.check_request(5, 4, {"budget_tokens": 1024})
    finally:
        w.shutdown()


def test_abort_and_early_close_free_the_request(worker):
    async def scenario():
        stream = worker.generate("long", PROMPT, LONG, RequestOptions())
        first = await stream.__anext__()
        assert await worker.abort("long") is True
        rest = [ev async for ev in stream]
        closed = worker.generate("closed", PROMPT, LONG, RequestOptions())
        await closed.__anext__()
        await closed.aclose()  # a consumer that goes away
        await asyncio.wrap_future(worker.loop.submit(lambda: None))  # the abort ran on the loop thread
        return first, rest, await worker.stats()

    first, rest, stats = asyncio.run(scenario())
    # Events produced before the abort may still be queued; then the stream ends, unfinished.
    assert [e.finish_reason for e in [first, *rest]] == [None] * (1 + len(rest))
    assert len(rest) < 100, "the request must stop long before its 200 tokens"
    assert stats["running"] == 0 and stats["queue_len"] == 0 and stats["pages_used"] == 0
    assert asyncio.run(worker.abort("long")) is False


def test_a_failed_step_fails_live_requests_and_the_loop_goes_on(worker, monkeypatch):
    engine = worker.loop.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device fault")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: injected device fault"):
        asyncio.run(_collect(worker, "doomed", PROMPT))
    assert worker.health()["error"] == "RuntimeError: injected device fault"
    events = asyncio.run(_collect(worker, "after", PROMPT))
    assert [t for e in events for t in e.token_ids] == reference_tokens(tuple(PROMPT), 5)
    assert asyncio.run(worker.stats())["pages_used"] == 0, "the failed request's pages were freed"


# ---- restarts and memory sizing -----------------------------------------------------------------


def test_restart_backoff_doubles_for_quick_crashes_and_resets_after_a_stable_run(store, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("lockserve.workers.actors.time.monotonic", lambda: clock[0])
    assert store.note_start("worker-0", False, 0.5, 4.0) == 0.0, "a first start does not wait"
    delays = []
    for _ in range(5):
        clock[0] += 1.0  # crashed a second after it started
        delays.append(store.note_start("worker-0", True, 0.5, 4.0))
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0], "doubling, capped at restart_backoff_max_s"
    clock[0] += 100.0  # ran longer than the cap: the next crash is not part of a loop
    assert store.note_start("worker-0", True, 0.5, 4.0) == 0.5
    starts = store.describe()["starts"]["worker-0"]
    assert starts["restarts"] == 6 and starts["last_delay_s"] == 0.5
    assert store.note_start("worker-1", True, 0.5, 4.0) == 0.5, "workers back off independently"


def test_auto_capacity_is_a_quarter_of_the_memory_available(tmp_path, monkeypatch):
    from lockserve.workers.memory import NodeMemory

    monkeypatch.setattr(NodeMemory, "measure", classmethod(lambda cls, shm_dir: cls(8 << 30, 100 << 30)))
    auto = NodeStore(None, shm_dir=str(tmp_path))
    assert auto.capacity_bytes == 2 << 30 and auto.describe()["capacity_auto"]
    monkeypatch.setattr(NodeMemory, "measure", classmethod(lambda cls, shm_dir: cls(8 << 30, 1 << 30)))
    assert NodeStore(None, shm_dir=str(tmp_path)).capacity_bytes == int(0.9 * (1 << 30)), \
        "never more than the shared-memory filesystem has free"
    monkeypatch.setattr(NodeMemory, "measure", classmethod(lambda cls, shm_dir: cls(4096, 1 << 30)))
    tight = NodeStore(None, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"needs 20480 bytes but the node's host capacity \(1024 bytes, "
                                         r"auto: 25% of 0.0 GiB available"):
        tight.region("worker-0", GEOMETRY.to_dict(), 5)


def test_worker_cache_resolves_auto_to_its_share_of_the_node():
    from lockserve.configs.schema import ServeCacheConfig
    from lockserve.workers.actors import worker_cache

    cache = worker_cache(ServeCacheConfig(), 0.5, node_capacity=4 << 30)
    assert type(cache) is CacheConfig and cache.host_capacity_gib == 2.0
    assert worker_cache(ServeCacheConfig(host_capacity_gib=3), 1.0).host_capacity_gib == 3.0
    with pytest.raises(ValueError, match="no node capacity was measured"):
        worker_cache(ServeCacheConfig(), 1.0)


def test_a_cpu_worker_takes_its_share_of_the_cores_or_the_configured_threads(monkeypatch):
    """Outside Ray the node is this machine: a worker's share of the cores it may run on but one
    (left to the front end and Ray), at least one; model.cpu_threads, when set, wins."""
    from lockserve.workers.actors import cpu_worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    assert cpu_worker_threads(None, 1.0) == 8 and cpu_worker_threads(None, 0.25) == 2
    assert cpu_worker_threads(None, 0.1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_worker_threads(None, 1.0) == 1
    assert cpu_worker_threads(3, 0.25) == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        ServeConfig(model={"cpu_threads": 0})


def test_max_model_len_past_the_models_positions_runs_past_them_with_a_warning(caplog):
    """model.max_model_len above the model's maximum context is an error naming both numbers (it
    was once silently capped, so a served request met a 400 at the model's length); with
    model.allow_long_max_model_len it extends them, with a warning."""
    trained = load_model("preset:tiny", device="cpu", dtype=torch.float32)[0].config.max_position_embeddings
    longer = _config().model_copy(deep=True)
    longer.model.max_model_len = 2 * trained
    message = rf"model\.max_model_len \({2 * trained}\) is past .* \({trained} positions.*model\.allow_long"
    with pytest.raises(ValueError, match=message):
        EngineWorker(longer, "worker-refused")
    longer.model.allow_long_max_model_len = True
    with caplog.at_level("WARNING", logger="lockserve.workers.actors"):
        w = EngineWorker(longer, "worker-long")
    try:
        assert w.limits().max_model_len == 2 * trained
        assert f"past its {trained} trained positions" in caplog.text
    finally:
        w.shutdown()
    shorter = _config().model_copy(deep=True)
    shorter.model.max_model_len = trained // 2  # a cap below the model's own: as before, no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="lockserve.workers.actors"):
        w = EngineWorker(shorter, "worker-short")
    try:
        assert w.limits().max_model_len == trained // 2 and "trained positions" not in caplog.text
    finally:
        w.shutdown()
