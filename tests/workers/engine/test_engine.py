"""The engine end to end on the tiny preset (real model, real tiers, CPU).

References: the model run with DenseAttention (itself tested against transformers), and the
engine's own runs where the claim is an equality between configurations (full budget == dense,
host / host+nvme == hbm, batched == alone).
"""

from __future__ import annotations

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.workers.engine.engine import Engine, RequestOptions
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.dense_attention import DenseAttention
from lockserve.workers.model.presets import build_preset

PAGE = 16
SMALL_BUDGET = 64  # 4 pages: prompts of 300 tokens are pruned hard
# A 4-byte-period pattern would be too easy to continue; bytes of a fixed pseudo-random walk instead.
_G = torch.Generator().manual_seed(0)
TOKENS = torch.randint(0, 256, (400,), generator=_G).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0, device="cpu")


def prompt(n: int, offset: int = 0) -> list[int]:
    return TOKENS[offset : offset + n]


def make_engine(tiny, tmp_path=None, *, max_pages=200, max_num_seqs=4, chunk=32, batched=64, **cache):
    cache.setdefault("tier", "hbm")
    if cache["tier"] == "host+nvme":
        cache.setdefault("nvme_dir", str(tmp_path / "nvme"))
    cc = CacheConfig(**{"hot_cache_pages": 128, "host_capacity_gib": 64 * 4096 / 2**30, **cache})
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, prefill_chunk=chunk)
    return Engine(*tiny, cc, sc, "cpu", max_pages=max_pages)


def run(engine: Engine, requests: dict) -> dict[str, list[int]]:
    """requests: id -> (prompt ids, params[, options]); returns id -> generated ids."""
    for rid, (ids, params, *options) in requests.items():
        engine.add_request(rid, ids, params, options[0] if options else None)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def dense_reference(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the model run with DenseAttention (whole prompt at once, then one by one)."""
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step(["s"], [len(ids)])
    dev = model.device
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), attn)
        out = []
        for i in range(n):
            out.append(int(model.compute_logits(hidden[-1:]).argmax()))
            attn.begin_step(["s"], [1])
            hidden = model(torch.tensor(out[-1:], device=dev), torch.tensor([len(ids) + i], device=dev), attn)
    return out


def test_dense_mode_matches_dense_attention(tiny):
    engine = make_engine(tiny, attention="dense")
    got = run(engine, {"a": (prompt(117), greedy(14)), "b": (prompt(40, 50), greedy(14))})
    assert got["a"] == dense_reference(tiny[0], prompt(117), 14)
    assert got["b"] == dense_reference(tiny[0], prompt(40, 50), 14)
    engine.close()


def test_locks_with_a_budget_covering_the_context_equals_dense(tiny):
    req = {"a": (prompt(150), greedy(16))}
    dense = run(make_engine(tiny, attention="dense"), req)
    full = run(make_engine(tiny, attention="locks", budget_tokens=256), req)
    small = run(make_engine(tiny, attention="locks", budget_tokens=48 + PAGE), req)
    assert full == dense
    assert small != dense, "a 4-page budget over 10 pages should change something (else the test is vacuous)"


@pytest.mark.parametrize("tier,spill_behind,wait", [
    ("host", True, None), ("host+nvme", True, None), ("host+nvme", True, False), ("host+nvme", False, None),
])
def test_offloaded_locks_equals_resident_locks(tiny, tier, spill_behind, wait, tmp_path):
    """host+nvme: 64 host slots, fewer than the 128-slot hot cache, so pages spill and come back;
    room made behind the step (the default: saved pages only, as allocations wait for queued prefix
    saves; with that wait off, spills written behind) or inline in the allocation."""
    requests = {str(i): (prompt(n, 7 * i), greedy(10)) for i, n in enumerate((300, 150, 40))}
    resident = run(make_engine(tiny, budget_tokens=SMALL_BUDGET), requests)
    engine = make_engine(tiny, tmp_path, tier=tier, budget_tokens=SMALL_BUDGET,
                         nvme_spill_behind=spill_behind, nvme_wait_for_saves=wait)
    assert run(engine, requests) == resident
    stats = engine.stats()
    assert stats["cache_hits"] > 0 and stats["bytes_moved"] > 0 and stats["pages_used"] == 0
    if tier == "host+nvme":  # decode found pages on NVMe, promoted them and ran the step again
        assert stats["nvme_spilled_pages"] > 0 and stats["nvme_promoted_pages"] > 0
        assert stats["nvme_missed_pages"] > 0 and stats["nvme_step_reruns"] >= stats["nvme_steps_missed"] > 0
        behind = stats["nvme_spilled_behind_pages"]  # spills written behind the step
        assert (behind > 0) if spill_behind and wait is False else (behind == 0), stats
    engine.close()


def test_host_and_nvme_capacities_add_up(tiny, tmp_path):
    """host+nvme holds host_capacity_gib + nvme_capacity_gib of KV (a page is in one of them): 64 host
    + 96 NVMe slots of 4 KiB are 26 page ids of 6 slots, so a 300-token prompt (20 ids) fits, which
    neither alone holds; it decodes to the resident tokens with at most 96 pages on NVMe."""
    slot = 4096  # the tiny model's page of one (layer, KV head): 2 x 16 x 32 x fp32
    engine = make_engine(tiny, tmp_path, tier="host+nvme", budget_tokens=SMALL_BUDGET, max_pages=None,
                         nvme_capacity_gib=96 * slot / 2**30)
    assert engine.kv.layout.geometry.slot_bytes == slot and engine.kv.layout.max_pages == 160 // 6
    requests = {"long": (prompt(300), greedy(10))}
    assert run(engine, requests) == run(make_engine(tiny, budget_tokens=SMALL_BUDGET), requests)
    store = engine.kv.settled.store
    assert store.nvme_slots == 96 and store.counters["spilled_pages"] > 0
    assert store.nvme.bytes_written > 0 and store.describe()["pages_nvme"] <= 96
    engine.close()
    with pytest.raises(ValueError, match=r"max_pages \(27\) needs .* GiB of KV, more than host_capacity_gib "
                                         r"\(.*\) \+ nvme_capacity_gib"):
        make_engine(tiny, tmp_path, tier="host+nvme", budget_tokens=SMALL_BUDGET, max_pages=27,
                    nvme_capacity_gib=96 * slot / 2**30)


def test_nvme_prefetch_runs_after_decode_steps_only(tiny, tmp_path):
    """The lookahead's record is written by decode layers: after a prefill-only forward it would be
    an older step's, so the tier is asked to prefetch once per step that decoded, never else."""
    engine = make_engine(tiny, tmp_path, tier="host+nvme", budget_tokens=SMALL_BUDGET, chunk=32)
    calls, prefetch = [], engine.kv.settled.prefetch_ahead

    def counted():
        calls.append(1)
        prefetch()

    engine.kv.settled.prefetch_ahead = counted
    engine.add_request("a", prompt(150), greedy(6))
    steps = []
    while engine.has_unfinished():
        steps.append(sum(len(o.token_ids) for o in engine.step()))
    # 150 tokens in chunks of 32, the tail from the last reusable page (144) on its own: six prefill
    # steps, the last samples the first token; five decodes
    assert steps == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1], steps
    assert len(calls) == 5, calls
    engine.close()


def test_concurrent_sequences_get_the_tokens_they_get_alone(tiny):
    lengths = (3, 300, 17, 230, 50, 160, 99)
    requests = {}
    for i, n in enumerate(lengths):
        params = greedy(8) if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=i,
                                                        ignore_eos=True)
        requests[f"r{i}"] = (prompt(n, 3 * i), params)
    engine = make_engine(tiny, tier="host", budget_tokens=SMALL_BUDGET, max_pages=60)
    together = run(engine, requests)
    assert engine.stats()["pages_used"] == 0
    for rid, req in requests.items():  # the same engine: page ids and cache slots get reused
        alone = run(engine, {rid: req})
        assert alone[rid] == together[rid], rid
    engine.close()


def test_admission_queues_beyond_max_num_seqs(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    for i in range(5):
        engine.add_request(str(i), prompt(20, i), greedy(3))
    engine.step()
    stats = engine.stats()
    assert (stats["running"], stats["queue_len"]) == (2, 3)
    assert stats["pages_used"] == 2 * 2  # 23 tokens = 2 pages each, reserved at admission
    done = run(engine, {})
    assert engine.stats()["pages_used"] == 0 and sorted(done) == ["0", "1", "2", "3", "4"]
    engine.close()


BAD_REQUESTS = [
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"prompt_ids": [1, 2, 300]}, "prompt_ids[2] (300) must be a token id in [0, 288)"),
    ({"prompt_ids": [1] * 4000, "params": greedy(200)}, "exceeds the model's maximum length (4096"),
    ({"prompt_ids": [1] * 1000}, "more than the engine's capacity (20 pages)"),
    ({"params": {"temperature": -1}}, "temperature (-1) must be >= 0"),
    ({"params": {"top_p": 1.5}}, "top_p (1.5) must be in (0, 1]"),
    ({"params": {"top_p": 0}}, "top_p (0) must be in (0, 1]"),
    ({"params": {"top_k": -2}}, "top_k (-2) must be >= 0"),
    ({"params": {"max_tokens": 0}}, "max_tokens (0) must be >= 1"),
    ({"options": RequestOptions(budget_tokens=20)}, "budget_tokens (20) must exceed sink_pages + recent"),
    ({"options": {"budget_tokens": -3}}, "budget_tokens (-3) must be > 0"),
    ({"options": RequestOptions(tier="host")}, "tier ('host') differs from the engine's tier ('hbm')"),
    ({"options": {"attention": "sparse"}}, "attention ('sparse') must be one of"),
    ({"request_id": "taken"}, "request_id ('taken') is already in use"),
]


def test_bad_input_is_refused_and_the_engine_keeps_serving(tiny):
    engine = make_engine(tiny, max_pages=20)
    engine.add_request("taken", prompt(10), greedy(2))
    for change, message in BAD_REQUESTS:
        args = {"request_id": "new", "prompt_ids": prompt(10), "params": greedy(4), "options": None, **change}
        with pytest.raises(ValueError) as err:
            engine.add_request(**args)
        assert message in str(err.value), change
    with pytest.raises(ValueError, match=r"more than the engine's capacity \(20 pages\)"):
        engine.check_request(400, greedy(4))
    assert engine.check_request(300, greedy(4)) == engine.budget_pages
    got = run(engine, {"ok": (prompt(30), greedy(6))})
    assert got["ok"] == dense_reference(tiny[0], prompt(30), 6)
    assert engine.stats()["pages_used"] == 0
    engine.close()


def test_engine_config_errors_name_the_field(tiny):
    with pytest.raises(ValueError, match=r"hot_cache_pages \(16\) must be >= max_num_seqs \(4\) x KV heads"):
        make_engine(tiny, tier="host", hot_cache_pages=16)
    # The typed config refuses these before the engine sees them (pydantic names field and value).
    with pytest.raises(ValueError, match=r"budget_tokens \(48\) must cover more than sink_pages"):
        make_engine(tiny, budget_tokens=48)
    with pytest.raises(ValueError, match=r"recent_pages\n.*greater than or equal to 1"):
        make_engine(tiny, recent_pages=0)


def test_abort_frees_pages_at_once_and_spares_the_others(tiny):
    engine = make_engine(tiny, tier="host", budget_tokens=SMALL_BUDGET)
    engine.add_request("victim", prompt(200), greedy(20))
    engine.add_request("other", prompt(90, 9), greedy(10))
    out = []
    for _ in range(4):  # victim is mid-prefill
        out += [t for o in engine.step() if o.request_id == "other" for t in o.token_ids]
    assert engine.abort("victim") and not engine.abort("victim") and not engine.abort("unknown")
    assert engine.stats()["pages_used"] == 7  # other's 100 tokens
    out += run(engine, {})["other"]
    assert engine.stats()["pages_used"] == 0 and engine.kv.num_free_tail_pages == engine.kv.write_rows
    fresh = make_engine(tiny, tier="host", budget_tokens=SMALL_BUDGET)
    alone = run(fresh, {"other": (prompt(90, 9), greedy(10))})
    assert out == alone["other"]
    engine.close()


def test_stop_token_ids_stop_strings_and_length(tiny):
    engine = make_engine(tiny)
    base = run(engine, {"a": (prompt(60), greedy(16))})["a"]
    stop_at = next(i for i in range(2, 16) if base[i] not in base[:i])
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base[stop_at]], ignore_eos=True)
    got = run(engine, {"b": (prompt(60), params)})
    assert got["b"] == base[: stop_at + 1]
    text = engine.tokenizer.decode(base)
    engine.add_request("c", prompt(60), greedy(16))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and "".join(o.text for o in outs) == text
    cut = next(i for i in range(1, len(text) - 1) if text[i : i + 2] not in text[: i + 1])
    params = SamplingParams(temperature=0, max_tokens=16, stop=[text[cut : cut + 2]], ignore_eos=True)
    engine.add_request("d", prompt(60), params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == text[:cut]
    engine.close()


def test_per_request_budget_and_dense_on_hbm(tiny):
    engine = make_engine(tiny, budget_tokens=SMALL_BUDGET)
    reqs = {"dense": (prompt(150), greedy(10), RequestOptions(attention="dense")),
            "full": (prompt(150), greedy(10), RequestOptions(budget_tokens=512))}
    got = run(engine, reqs)
    want = run(make_engine(tiny, attention="dense"), {"x": (prompt(150), greedy(10))})["x"]
    assert got["dense"] == want and got["full"] == want
    engine.close()


def test_stats_report_capacity_and_tier_traffic(tiny, tmp_path):
    engine = make_engine(tiny, tmp_path, tier="host+nvme", budget_tokens=SMALL_BUDGET)
    engine.add_request("a", prompt(120), greedy(30))
    for _ in range(6):
        engine.step()
    stats = engine.stats()
    assert stats["running"] == 1 and stats["pages_used"] == 10 and stats["pages_capacity"] == 200
    assert stats["tier"] == "host+nvme" and stats["bytes_written"] > 0
    assert set(stats["bytes_per_tier"]) >= {"host", "cache"} and 0 <= stats["hit_rate"] <= 1
    engine.close()


def test_the_hot_cache_is_a_gpu_cache_unless_asked_for(tiny):
    """hot_cache_pages auto: no cache on CPU (it would copy host memory into host memory), 4096
    slots on a GPU; a number asks for a cache anywhere (CPU: its torch reference, as in tests)."""
    assert CacheConfig().hot_cache_slots(on_gpu=True) == 4096
    assert CacheConfig().hot_cache_slots(on_gpu=False) == 0
    assert CacheConfig(hot_cache_pages=64).hot_cache_slots(on_gpu=False) == 64
    auto = make_engine(tiny, tier="host", hot_cache_pages="auto")
    asked = make_engine(tiny, tier="host", hot_cache_pages=256)
    assert auto.kv.settled.cache is None and asked.kv.settled.cache is not None
    same = run(auto, {"x": (prompt(150), greedy(8))}), run(asked, {"x": (prompt(150), greedy(8))})
    assert same[0] == same[1], "the cache changes where a page is read from, never the tokens"
    auto.close(), asked.close()


def test_progress_bar_only_when_asked(tiny, capsys):
    for show in (False, True):
        engine = make_engine(tiny, chunk=16)
        engine.show_progress = show
        run(engine, {"long": (prompt(16 * 4 + 5), greedy(2))})
        err = capsys.readouterr().err
        assert ("prefill long" in err) == show, err
        engine.close()


def test_synthetic_fill_shows_a_bar_of_its_tokens_only_when_asked(tiny, capsys, monkeypatch):
    from lockserve.workers.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "FILL_BAR_MIN_TOKENS", 100)  # the default skips tiny fills
    for show in (False, True):
        engine = make_engine(tiny)
        engine.show_progress = show
        for rid, n in (("short", 90), ("long", 16 * 20 + 3)):
            engine.add_request(rid, prompt(n), greedy(2))
            engine.fill_synthetic(rid)
        err = capsys.readouterr().err
        assert ("synthetic fill long" in err) == show, err
        assert "synthetic fill short" not in err, "a fill below FILL_BAR_MIN_TOKENS takes no bar"
        assert ("/323 " in err) == show, "the bar's total is the prompt's tokens"
        engine.close()
    engine = make_engine(tiny)
    engine.add_request("r", prompt(16 * 20 + 3), greedy(2))
    seq = engine._live["r"]
    engine.scheduler.admit()
    stored = []
    engine.kv.fill_random("r", seq.pids, seq.num_prompt, seed=0, chunk_pages=8, on_pages=stored.append)
    assert stored == [8, 8, 4], "each chunk of full pages is reported as it is stored"
    engine.close()


def test_nvme_reruns_recover_without_the_host_path_when_a_step_fits_host_memory(tiny, tmp_path):
    """With room in host memory for one step's selections (128 host slots here), a step that finds
    a page on NVMe promotes it and reruns on the device path; the tokens stay hbm's. With less room
    (64 slots) some steps fall back to host reads layer by layer, and the tokens still stay."""
    requests = {str(i): (prompt(n, 7 * i), greedy(10)) for i, n in enumerate((300, 150, 40))}
    resident = run(make_engine(tiny, budget_tokens=SMALL_BUDGET), requests)
    for slots in (128, 64):
        engine = make_engine(tiny, tmp_path / str(slots), tier="host+nvme", budget_tokens=SMALL_BUDGET,
                             host_capacity_gib=slots * 4096 / 2**30)
        assert run(engine, requests) == resident, f"{slots} host slots"
        stats = engine.stats()
        assert stats["nvme_steps_missed"] > 0 and stats["nvme_step_reruns"] > stats["nvme_sync_steps"]
        engine.close()


PAGE_TOKENS = 16


def warm_up_traces(eng) -> tuple[float, list]:
    traces = []
    eng.attention.observer = traces.append
    seconds = eng.warm_up()
    eng.attention.observer = None
    return seconds, traces


@pytest.mark.parametrize("tier", ["hbm", "host"])
def test_warm_up_leaves_the_engine_as_new(tiny, tier):
    """Engine.warm_up (a GPU worker runs it before reporting ready) scores and selects pages as a
    long request does, then attends every page as a short request does (the dense selection's
    kernel compiled and its graphs captured before a user's short request), decodes past a page,
    and leaves no page used, token counters at zero and the next requests' tokens unchanged."""
    requests = {"a": (prompt(120), greedy(10)), "b": (prompt(40, 3), greedy(6))}
    want = run(make_engine(tiny, tier=tier, budget_tokens=SMALL_BUDGET), requests)
    eng = make_engine(tiny, tier=tier, budget_tokens=SMALL_BUDGET)
    seconds, traces = warm_up_traces(eng)
    assert seconds > 0 and any(t.scores is not None for t in traces), "the warm-up must run the scored path"
    assert traces[-1].scores is None, "and then the dense one (a short request's decode)"
    stats = eng.stats()
    assert stats["pages_used"] == 0 and not eng.has_unfinished()
    assert (stats["steps"], stats["prompt_tokens"], stats["generated_tokens"]) == (0, 0, 0)
    assert stats["eager_steps"] >= PAGE_TOKENS + 2, "the warm-up decodes past a page (runner counters stay)"
    assert run(eng, requests) == want
    eng.add_request("c", prompt(20), greedy(2))
    with pytest.raises(RuntimeError, match="requests in flight"):
        eng.warm_up()
    eng.close()


def test_warm_up_shrinks_or_is_skipped_where_it_does_not_fit(tiny):
    eng = make_engine(tiny, budget_tokens=SMALL_BUDGET, max_pages=5)  # two pages of prompt fit, six do not
    seconds, traces = warm_up_traces(eng)
    assert seconds > 0 and traces and all(t.scores is None for t in traces)
    eng.close()
    eng = make_engine(tiny, max_pages=3)
    assert eng.warm_up() == 0.0
    assert eng.stats()["pages_used"] == 0
    eng.close()
