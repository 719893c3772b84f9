"""The retrieval evaluation's parts: needle prompts, a prompt's KV moved between engines, the
decode observer, and the first-step metrics (tiny preset, byte-level tokenizer, CPU)."""

from __future__ import annotations

import pytest
import torch
from lockserve.cluster.measure.eval.needles import TASKS, answer_score, build_needle_prompt
from lockserve.cluster.measure.eval.retrieval import RetrievalRunner, agreement, cut_at_stop, parse_spec
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.workers.engine.attention import DecodeTrace
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.presets import build_preset
from lockserve.workers.model.tokenizer import byte_level_tokenizer

PAGE = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0, device="cpu")


# ---- needle prompts ------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("chat", [True, False])
def test_carriers_are_the_answers_digits(task, chat):
    tok = byte_level_tokenizer()
    p = build_needle_prompt(tok, task, 2500, 0.3, seed=3, chat=chat)
    assert abs(len(p.prompt_ids) - 2500) <= 64 and len(set(p.answers)) == len(p.answers)
    for answer, positions in zip(p.answers, p.carriers, strict=True):
        occurrences = 2 if task == "passkey" else 1  # the pass-key needle says its key twice
        assert tok.decode([p.prompt_ids[i] for i in positions]) == answer * occurrences
    assert p.carrier_pages(PAGE)[0] == {t // PAGE for t in p.carriers[0]}
    target = p.carriers[0][0] / len(p.prompt_ids)
    assert abs(target - 0.3) < 0.08, target  # the asked-for needle at its depth (intro and frame aside)


def test_seeds_change_needles_and_haystack():
    tok = byte_level_tokenizer()
    a, b = (build_needle_prompt(tok, "multikey", 1500, 0.5, seed=s) for s in (0, 1))
    assert a.answers != b.answers and a.prompt_ids[200:400] != b.prompt_ids[200:400]
    assert build_needle_prompt(tok, "multikey", 1500, 0.5, seed=0) == a


def test_answer_score_counts_whole_numbers():
    tok = byte_level_tokenizer()
    p = build_needle_prompt(tok, "multivalue", 1500, 0.5, seed=0)
    x, y, z = p.answers
    assert answer_score(p, f"{x}, {z}.") == pytest.approx(2 / 3)
    assert answer_score(p, f"{x}{y} and 1{z}") == 0.0
    with pytest.raises(ValueError, match=r"task \('haystack'\)"):
        build_needle_prompt(tok, "haystack", 1500, 0.5)
    with pytest.raises(ValueError, match=r"context_tokens \(40\)"):
        build_needle_prompt(tok, "passkey", 40, 0.5)


def test_agreement_and_stops():
    assert cut_at_stop([5, 6, 257, 7], {257}) == [5, 6]
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 9, 4], [1, 2, 3, 4]) == pytest.approx(1 / 3)  # the shared first token excluded
    assert agreement([1, 2], [1, 2, 3, 4]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("text,message", [
    ("locks:nvme", r"tier \('nvme'\)"), ("quest,rank", r"'rank' must be field=value"),
    ("locks,page_size=32", r"'page_size=32' must be field=value"), ("dense", "FullKV reference"),
    ("locks,basis_bits=3", r"basis_bits \(3\) must be one of 16, 8, 4, 2"), ("sparse", "attention"),
])
def test_bad_selector_specs_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_selector_specs_parse():
    spec = parse_spec("locks:host,rank=4,basis_bits=2")
    assert (spec.attention, spec.tier, dict(spec.fields)) == ("locks", "host", {"rank": 4, "basis_bits": 2})
    assert spec.cache_config(128).budget_tokens == 128 and parse_spec("quest").tier == "hbm"


# ---- a prompt's KV moved between engines -------------------------------------------------------


def make_engine(tiny, **cache) -> Engine:
    cc = CacheConfig(**{"tier": "hbm", "budget_tokens": 64, "hot_cache_pages": 96, **cache})
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, prefill_chunk=512)
    return Engine(*tiny, cc, sc, "cpu", max_pages=100, use_graphs=False)


def decode(engine: Engine, ids: list[int], n: int = 10) -> list[int]:
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.token_ids)
    return out


PROMPT = [(31 * i + 7) % 256 for i in range(421)]  # 26 full pages and an open one


@pytest.mark.parametrize("attention,tier", [("locks", "hbm"), ("locks", "host"), ("quest", "hbm"),
                                            ("shared_sequence", "hbm"), ("oracle", "host")])
def test_filled_kv_decodes_as_the_engines_own_prefill(tiny, attention, tier):
    """A dense engine's KV after prefill, filled into a selector engine, decodes exactly as that
    engine does after prefilling the prompt itself (one chunk: the same pages reach the tables)."""
    own = decode(make_engine(tiny, attention=attention, tier=tier), PROMPT)
    dense = make_engine(tiny, attention="dense")
    dense.add_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    first = []
    while not first:
        first = [t for o in dense.step() for t in o.token_ids]
    prefilled = dense.export_prefill("d")
    assert prefilled.pages.shape == (3, 27, 2, 2, PAGE, 32) and prefilled.first_token == own[0]
    eng = make_engine(tiny, attention=attention, tier=tier)
    eng.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    out = list(eng.fill_prefilled("r", prefilled).token_ids)
    while eng.has_unfinished():
        out.extend(t for o in eng.step() for t in o.token_ids)
    assert out == own, f"{attention}/{tier}: filled {out} != own prefill {own}"
    assert sum(out) and len(set(out)) > 1


def test_export_and_fill_refuse_the_wrong_requests(tiny):
    dense = make_engine(tiny, attention="dense")
    dense.add_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="prefill has just finished"):
        dense.export_prefill("d")
    while not dense.step():
        pass
    prefilled = dense.export_prefill("d")
    dense.step()
    with pytest.raises(ValueError, match="prefill has just finished"):
        dense.export_prefill("d")
    eng = make_engine(tiny)
    eng.add_request("r", PROMPT[:-1], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="its prompt"):
        eng.fill_prefilled("r", prefilled)


def test_observer_sees_every_decode_layer_and_nothing_without_it(tiny):
    eng = make_engine(tiny, attention="locks")
    traces: list[DecodeTrace] = []
    eng.attention.observer = traces.append
    decode(eng, PROMPT, n=3)
    layers = tiny[0].config.num_layers
    assert [t.layer for t in traces] == list(range(layers)) * 2  # two decode steps after the prefill
    t = traces[0]
    assert t.q.shape == (1, 4, 32) and t.selection.idx.shape[:2] == (1, 2)
    assert t.scores.s_hat.shape[:3] == (1, 2, 2)
    assert int((t.selection.lens > 0).sum(-1).max()) == 4  # a 64-token budget is 4 pages
    eng.attention.observer = None
    traces.clear()
    decode(eng, PROMPT, n=3)
    assert traces == []


# ---- first-step metrics --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tiny):
    tok = byte_level_tokenizer()
    prompt = build_needle_prompt(tok, "multivalue", 1200, 0.5, seed=1)
    runner = RetrievalRunner(tiny[0], tok, "cpu", [64, 128, 2048], 1300, calibration_tokens=400)
    specs = [parse_spec(s) for s in ("oracle", "locks", "quest", "locks,group_rule=group_mass")]
    try:
        yield prompt, runner.run(prompt, specs)
    finally:
        runner.close()


def test_oracle_keeps_every_carrier_it_is_counted_against(evaluated):
    _, out = evaluated
    for r in (r for r in out["records"] if r["selector"] == "oracle"):
        c = r["carrier_counts"]
        assert c["both"] == c["oracle"] == c["selected"]
        assert c["total"] == 3 * 2 * 3  # layers x KV heads x answers
        assert r["captured_mass"] == pytest.approx(r["oracle_mass"]) and r["lse_mae"] < 1e-5
        assert r["spearman"] == pytest.approx(1.0)


def test_a_budget_that_covers_the_prompt_is_dense(evaluated):
    prompt, out = evaluated
    for r in (r for r in out["records"] if r["budget_tokens"] == 2048):
        same = cut_at_stop(r["tokens"], {257, 259}) == cut_at_stop(out["fullkv"]["tokens"], {257, 259})
        assert r["captured_mass"] == pytest.approx(1.0) and same, r["selector"]
        assert r["agreement"] == 1.0 and r["score"] == out["fullkv"]["score"]


def test_records_carry_every_metric(evaluated):
    prompt, out = evaluated
    assert len(out["records"]) == 4 * 3
    for r in out["records"]:
        assert 0 <= r["captured_mass"] <= r["oracle_mass"] + 0.05 and 0 < r["oracle_mass"] <= 1
        c = r["carrier_counts"]
        assert c["both"] <= min(c["oracle"], c["selected"]) <= c["total"] == 18
        assert 1 <= len(r["tokens"]) <= prompt.max_tokens and r["tokens"][0] == out["fullkv"]["tokens"][0]
    rules = [r for r in out["records"] if "group_rule" in r["selector"]]
    assert all(r["lse_mae"] is None for r in rules)  # one adapted head: no per-head log-mass estimate
    small = [r for r in out["records"] if r["budget_tokens"] == 64]
    assert min(r["oracle_mass"] for r in small) < 0.5  # the budget prunes: the metrics have something to see


@pytest.mark.slow
def test_carriers_with_smollm2s_tokenizer():
    """A BPE vocabulary (SmolLM2's: digits are single tokens, words merge): the carrier positions are
    still exactly the answer's digits."""
    from lockserve.workers.model.loader import load_model

    _, tok = load_model("default", device=torch.device("cpu"))
    for task in TASKS:
        p = build_needle_prompt(tok, task, 1500, 0.7, seed=2)
        for answer, positions in zip(p.answers, p.carriers, strict=True):
            text = tok.decode([p.prompt_ids[i] for i in positions])
            assert text.replace(" ", "") == answer * (2 if task == "passkey" else 1), (task, text)
