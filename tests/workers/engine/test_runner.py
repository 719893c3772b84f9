"""The model runner's bookkeeping on CPU: decode rows kept on the device across steps, the graph
keys (batch and width buckets, selection width) and the padded decode step that a CUDA graph
replays, run eagerly here (`pad_decode`) so that its null rows and padding are checked in CI.

The claims: padded steps give exactly the tokens of exact-shape steps while requests of different
lengths and budgets finish, abort and join so the batch moves between buckets and pages fill;
rows stay compact and their device fields say where each sequence is.
"""

from __future__ import annotations

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.workers.engine import RequestOptions
from lockserve.workers.engine.decode_state import NULL_ROW, DecodeState, F, width_bucket
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.runner import batch_bucket
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.engine.scheduler import Chunk
from lockserve.workers.engine.sequence import Sequence
from lockserve.workers.model.presets import build_preset

from tests.workers.engine.test_engine import SMALL_BUDGET, greedy, make_engine, prompt, run

PAGE = 16


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0, device="cpu")


def test_buckets():
    assert [batch_bucket(n, 64) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert batch_bucket(5, 6) == 6  # capped at max_num_seqs
    assert [width_bucket(p) for p in (1, 64, 65, 100, 129, 8192, 8193, 9000)] == \
        [64, 64, 128, 128, 192, 8192, 9216, 9216]
    for p in range(1, 20000, 7):  # at most 12.5% padding past 64 pages, never less than p
        assert p <= width_bucket(p) <= max(64, p * 1.125 + 64)


def seq(name: str, n_prompt: int, pids: list[int], budget=None) -> Sequence:
    s = Sequence(name, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=50), None, None,
                 frozenset(), budget)
    s.pids = pids
    return s


def test_rows_stage_fields_and_compact_on_removal():
    state = DecodeState(max_rows=4, max_pages=8, page_size=PAGE, device=torch.device("cpu"))
    a, b, c = seq("a", 21, [5, 6, 7]), seq("b", 17, [1, 2], budget=4), seq("c", 48, [9, 10, 11, 12])
    decodes = [Chunk(s, pos, 1) for s, pos in ((a, 20), (b, 16), (c, 47))]
    ordered = state.order(decodes)
    assert [ch.seq.request_id for ch in ordered] == ["a", "b", "c"]
    state.stage(ordered, [6, 2, 11])
    meta = state.meta
    # a: position 20 -> page 1 (2 pages), 5 tokens in it; b: position 16 opens page 1; c: 47 fills page 2
    assert meta[F["num_pages"], :3].tolist() == [2, 2, 3]
    assert meta[F["num_settled"], :3].tolist() == [1, 1, 2]
    assert meta[F["tail_len"], :3].tolist() == [5, 1, 16]
    assert meta[F["tail_off"], :3].tolist() == [4, 0, 15]
    assert meta[F["tail_loc"], :3].tolist() == [6, 2, 11]
    assert meta[F["position"], :3].tolist() == [20, 16, 47]
    assert meta[F["budget"], :3].tolist()[1] == 4
    assert meta[F["token"], :3].tolist() == [120, 116, 147]  # the token at each position
    assert state.page_table[2, :4].tolist() == [9, 10, 11, 12]
    assert meta[F["tail_loc"], 3] == NULL_ROW["tail_loc"] and meta[F["tail_len"], 3] == 0
    state.remove("a")  # c moves into row 0
    assert [s.request_id for s in state.seqs] == ["c", "b"]
    assert state.page_table[0, :4].tolist() == [9, 10, 11, 12]
    assert state.host[F["tail_loc"], 0] == 11 and state.host[F["tail_len"], 2] == NULL_ROW["tail_len"]
    with pytest.raises(RuntimeError, match="2 decode rows but 1 decodes"):
        state.order([Chunk(b, 17, 1)])
    state.remove("b")
    state.remove("b")  # unknown: nothing
    assert [s.request_id for s in state.seqs] == ["c"]


def test_a_sequence_wider_than_the_page_table_is_refused():
    state = DecodeState(max_rows=2, max_pages=2, page_size=PAGE, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="has 3 pages, more than the page table's 2 columns"):
        state.order([Chunk(seq("x", 20, [1, 2, 3]), 20, 1)])


REQUESTS = {  # lengths, budgets and lengths of output differ: the batch shrinks 6 -> 1 across buckets
    "a": (prompt(300), greedy(14)),
    "b": (prompt(150, 7), greedy(5), RequestOptions(budget_tokens=SMALL_BUDGET + 3 * PAGE)),
    "c": (prompt(31, 3), greedy(9)),
    "d": (prompt(200, 11), greedy(12), RequestOptions(budget_tokens=SMALL_BUDGET)),
    "e": (prompt(64, 5), greedy(3)),
    "f": (prompt(90, 2), greedy(7)),
}


@pytest.mark.parametrize("tier,attention", [("hbm", "locks"), ("host", "locks"), ("hbm", "dense")])
def test_padded_decode_steps_give_the_exact_steps_tokens(tiny, tier, attention):
    exact = make_engine(tiny, tier=tier, attention=attention, budget_tokens=2 * SMALL_BUDGET, max_num_seqs=6)
    want = run(exact, REQUESTS)
    padded = make_engine(tiny, tier=tier, attention=attention, budget_tokens=2 * SMALL_BUDGET, max_num_seqs=6)
    padded.runner.pad_decode = True
    padded.runner.min_width = 8  # short prompts cross width buckets too
    keys = []
    for rid, (ids, params, *options) in REQUESTS.items():
        padded.add_request(rid, ids, params, options[0] if options else None)
    got = {rid: [] for rid in REQUESTS}
    aborted = False
    while padded.has_unfinished():
        for out in padded.step():
            got[out.request_id] += out.token_ids
        keys.append(padded.runner.last_padded)
        padded.runner.last_padded = None
        if len(got["f"]) == 4 and not aborted:  # f leaves mid-decode: the rows compact
            aborted = padded.abort("f")
    assert aborted
    for rid in REQUESTS:
        n = 4 if rid == "f" else len(want[rid])
        assert got[rid] == want[rid][:n], rid
    steps = [s for s in keys if s is not None]
    rows = {key.rows for _, key in steps}
    assert len(rows) >= 3, f"the batch should cross buckets: {rows}"
    assert any(key.rows > n for n, key in steps), "some steps must carry null rows"
    assert len({key.width for _, key in steps}) >= 2, "pages should fill past a width bucket"
    if attention == "locks":
        assert any(key.scored for _, key in steps), "some rows must have more pages than their budget"
    # decode rows beside prefill chunks ran as their padded step, the chunks in a forward apart
    assert padded.runner.counters["split_steps"] > 0 and exact.runner.counters["split_steps"] == 0
    assert padded.stats()["pages_used"] == 0 and len(padded.runner.state) == 0
    padded.close()
    exact.close()


@pytest.mark.parametrize("tier", ["host", "host+nvme"])
def test_unpruned_rows_in_a_wide_bucket_stay_within_the_tiers_read_rows(tiny, tmp_path, tier):
    """Rows with no more pages than their budget attend every page, and the padded step's width
    bucket (64 pages at least) is wider than a small budget: the step must still ask the tier for
    no more pages than its read rows hold (max_num_seqs x KV heads x budget pages). The lent H200
    found this (tests/cluster/test_ray_gpu.py: 128 slots asked of 32)."""
    requests = {"a": (prompt(37), greedy(6)), "b": (prompt(40, 9), greedy(4))}
    kw = dict(tier=tier, budget_tokens=SMALL_BUDGET, hot_cache_pages=256, max_num_seqs=4)
    want = run(make_engine(tiny, tmp_path / "exact", **kw), requests)
    padded = make_engine(tiny, tmp_path / "padded", **kw)
    padded.runner.pad_decode = True  # the default min_width: every key is 64 pages wide
    got = run(padded, requests)
    n, key = padded.runner.last_padded
    assert key.width == 64 and not key.scored
    assert key.rows * tiny[0].config.num_kv_heads * key.k <= padded.kv.spec.max_selected
    assert got == want
    padded.close()


@pytest.mark.parametrize("tier", ["host", "host+nvme"])
@pytest.mark.parametrize("pad", [False, True])
def test_every_forward_is_one_step_of_the_hot_cache(tiny, tmp_path, pad, tier):
    """The hot cache's lookups of one forward share a step, and the step advances once per forward
    (begin_forward, inside the forward: captured with a decode graph), on the eager path and the
    padded decode path alike (where chunks beside decode rows run in a forward of their own, within
    the rows' step). On host+nvme the device clock that stamps selected pages advances in
    the same place and stays equal to the host's count of forwards (the LRU touches compare them)."""
    engine = make_engine(tiny, tmp_path, tier=tier, budget_tokens=SMALL_BUDGET, max_num_seqs=4)
    engine.runner.pad_decode = pad
    source = engine.kv.settled
    cache = source.cache
    assert cache is not None and cache.commit == "inline"
    for rid, (ids, params) in {"a": (prompt(70), greedy(9)), "b": (prompt(45, 3), greedy(5))}.items():
        engine.add_request(rid, ids, params)
    forwards = 0
    while engine.has_unfinished():
        engine.step()
        forwards += 1
        if tier == "host+nvme":
            assert int(source._clock) == source._forwards
    stats = cache.stats()
    assert stats.requests > 0, "the decode steps looked pages up"
    if tier == "host+nvme":
        assert source._forwards >= forwards  # a forward that missed ran again
        forwards = source._forwards
    assert stats.steps == forwards
    if pad:
        assert engine.runner.last_padded is not None
        assert engine.runner.counters["split_steps"] > 0, "b decoded beside a's prefill"
    engine.close()


def spread_engine(tiny, tmp_path, tier: str, layers: int | None):
    """An engine whose decode rows run apart from prefill chunks (pad_decode, as with graphs), a
    prompt's chunk forward spread over steps `layers` layers at a time (None: whole)."""
    engine = make_engine(tiny, tmp_path / f"{tier}-{layers}", tier=tier, budget_tokens=SMALL_BUDGET)
    engine.scheduler_config = engine.scheduler_config.model_copy(update={"prefill_layers_decoding": layers})
    engine.runner.pad_decode = True
    return engine


def beside(engine, decoder_tokens: int, abort_after_parts: int | None = None) -> tuple[dict, list]:
    """A request decodes; a 150-token prompt (six chunks of at most 32 tokens) joins it. Returns the tokens of
    both and, per step, (whether a chunk's forward was left under way, the requests that got a
    token). abort_after_parts: abort the prompt once that many parts ran, then send it again."""
    engine.add_request("d", prompt(40, 4), greedy(decoder_tokens))
    got, steps = {"d": [], "p": []}, []
    while not got["d"]:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    engine.add_request("p", prompt(150, 9), greedy(6))
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            got[out.request_id] += out.token_ids
        steps.append((engine.runner.inflight is not None, {out.request_id for out in outs}))
        if abort_after_parts is not None and engine.runner.counters["prefill_parts"] >= abort_after_parts:
            assert engine.runner.inflight is not None and engine.abort("p")
            assert engine.runner.inflight is None and engine.scheduler.pinned is None
            abort_after_parts, got["p"] = None, []
            engine.add_request("p", prompt(150, 9), greedy(6))  # its cached pages: only whole chunks'
    return got, steps


@pytest.mark.parametrize("tier", ["hbm", "host", "host+nvme"])
def test_a_prompt_spread_over_steps_a_layer_at_a_time_gives_the_same_tokens(tiny, tmp_path, tier):
    """scheduler.prefill_layers_decoding: beside a decoding request a chunk's forward runs a layer a
    step (tiny has three), the decoder taking a token every step meanwhile. Both requests' tokens
    equal those of whole-forward steps, when the decoder outlives the prompt's prefill and when it
    leaves mid-forward (the rest of the layers then run at once); a prompt aborted mid-forward
    and sent again gets them too, and no page is left in use but idle cached ones."""
    def pages_left(engine):
        return engine.scheduler.allocator.num_used - (engine.prefix.num_idle if engine.prefix else 0)

    wants = {}
    for decoder_tokens in (40, 8):
        whole = spread_engine(tiny, tmp_path, tier, None)
        wants[decoder_tokens], whole_steps = beside(whole, decoder_tokens)
        assert whole.runner.counters["prefill_parts"] == 0 and not any(i for i, _ in whole_steps)
        whole.close()
        engine = spread_engine(tiny, tmp_path, tier, 1)
        got, steps = beside(engine, decoder_tokens)
        assert got == wants[decoder_tokens] and len(got["p"]) == 6 and len(got["d"]) == decoder_tokens
        under_way = [who for inflight, who in steps if inflight]
        assert len(under_way) >= 2 and all("d" in who for who in under_way), steps  # it decoded meanwhile
        if decoder_tokens == 40:  # six chunks (4 x 32, then 16 and 6: the last reusable page's own) beside
            # it: three parts each, the first two leaving the forward under way (on host+nvme a step
            # whose decode rows missed a page runs again, its part too)
            parts = engine.runner.counters["prefill_parts"]
            assert len(under_way) == 12 and (parts == 18 if tier != "host+nvme" else parts >= 18), steps
        assert pages_left(engine) == 0
        engine.close()
    again = spread_engine(tiny, tmp_path / "again", tier, 1)
    got, _ = beside(again, 40, abort_after_parts=5)  # mid the second chunk's forward
    assert got == wants[40] and pages_left(again) == 0
    again.close()


def test_layers_a_step_without_graphs_say_they_do_nothing(tiny, caplog):
    """On the CPU (no CUDA graphs) decode rows and prompt chunks share one forward, so
    scheduler.prefill_layers_decoding cannot apply: the engine says so when it is built."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32,
                         prefill_layers_decoding=2)
    with caplog.at_level("WARNING", logger="lockserve.workers.engine.engine"):
        Engine(*tiny, CacheConfig(tier="hbm"), sc, "cpu", max_pages=64).close()
    assert "prefill_layers_decoding (2) has no effect here" in caplog.text
    assert "CUDA graphs need a CUDA device" in caplog.text
