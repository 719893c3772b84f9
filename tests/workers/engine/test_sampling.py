"""Sampling: parameter validation, filters vs a brute-force reference, the draw's distribution,
per-request generators, stop rules and the text held back for stop strings."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.workers.engine.sampling import (
    SamplingParams,
    check_stop,
    filtered_probs,
    find_stop,
    make_generator,
    sample,
    stop_prefix_len,
)
from lockserve.workers.engine.sequence import Sequence
from lockserve.workers.model.tokenizer import byte_level_tokenizer


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", -0.5, "temperature (-0.5) must be >= 0"),
        ("temperature", math.nan, "temperature (nan) must be a finite number"),
        ("top_p", 0.0, "top_p (0.0) must be in (0, 1]"),
        ("top_p", 1.5, "top_p (1.5) must be in (0, 1]"),
        ("top_k", -1, "top_k (-1) must be >= 0"),
        ("max_tokens", 0, "max_tokens (0) must be >= 1"),
        ("max_tokens", -3, "max_tokens (-3) must be >= 1"),
        ("max_tokens", 2.5, "max_tokens (2.5) must be an integer"),
        ("max_tokens", True, "max_tokens (True) must be an integer"),
        ("seed", -1, "seed (-1) must be in"),
        ("stop", [""], "stop ([''])"),
        ("stop_token_ids", [-2], "stop_token_ids ([-2]) must be >= 0"),
    ],
)
def test_invalid_params_name_field_and_value(field, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert message in str(err.value)


def test_coerce_takes_dicts_and_lookalikes():
    class Other:  # e.g. the HTTP layer's params: same field names
        max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids = 5, 0.0, 1.0, 0, None, ["x"], []

    assert SamplingParams.coerce(Other()) == SamplingParams(max_tokens=5, temperature=0.0, stop=["x"])
    assert SamplingParams.coerce({"max_tokens": 3}).max_tokens == 3
    with pytest.raises(ValueError, match=r"top_p \(2\)"):
        SamplingParams.coerce({"top_p": 2})


def brute_force_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row: temperature, keep the top_k best, then the smallest prefix with mass >= top_p."""
    x = logits.double() / p.temperature
    order = sorted(range(x.numel()), key=lambda i: -float(x[i]))
    if p.top_k:
        order = order[: p.top_k]
    probs = torch.softmax(x[order], dim=0)
    kept, mass = [], 0.0
    for i, pr in zip(order, probs.tolist(), strict=True):
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += pr
    out = torch.zeros_like(x)
    out[kept] = torch.softmax(x[kept], dim=0)
    return out.float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_probs_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 37, generator=g) * 3
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=9, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ]
    got = filtered_probs(logits, params, logits.device)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], brute_force_probs(logits[i], p), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, p=p: f"{p}\n{m}")


def test_greedy_rows_take_argmax_and_draw_no_noise():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    before = [g.get_state() for g in gens]
    ids = sample(logits, [SamplingParams(temperature=0)] * 3, gens)
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, before, strict=True))


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=0.8, top_k=4)
    want = filtered_probs(logits, [p], logits.device)[0]
    gen = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[int(sample(logits, [p], [gen]))] += 1
    freq = counts / n
    assert counts[4:].sum() == 0, "tokens outside top_k were drawn"
    # 4 sigma of a binomial proportion at n = 6000 is < 0.026
    torch.testing.assert_close(freq, want, atol=0.026, rtol=0)


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    mine = torch.randn(1, 200, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    rng = torch.Generator().manual_seed(0)
    alone, batched = make_generator(p, torch.device("cpu"), rng), make_generator(p, torch.device("cpu"), rng)
    others = [SamplingParams(temperature=1.0, seed=s) for s in (5, 6)]
    other_gens = [make_generator(o, torch.device("cpu"), rng) for o in others]
    seq_alone, seq_batched = [], []
    for _ in range(20):
        seq_alone.append(int(sample(mine, [p], [alone])[0]))
        batch = torch.cat([torch.randn(1, 200, generator=g), mine, torch.randn(1, 200, generator=g)])
        ids = sample(batch, [others[0], p, others[1]], [other_gens[0], batched, other_gens[1]])
        seq_batched.append(int(ids[1]))
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 3, "temperature 1 over 200 tokens should vary"


def test_unseeded_generators_come_from_the_engine_rng():
    p = SamplingParams(temperature=1.0)
    a = make_generator(p, torch.device("cpu"), torch.Generator().manual_seed(7))
    b = make_generator(p, torch.device("cpu"), torch.Generator().manual_seed(7))
    c = make_generator(p, torch.device("cpu"), torch.Generator().manual_seed(8))
    assert a.initial_seed() == b.initial_seed() != c.initial_seed()


def test_stop_rules():
    p = SamplingParams(max_tokens=4, stop=["END", "xy"], stop_token_ids=[9])
    ids = frozenset({9, 2})
    assert check_stop(9, 1, "ab", 1, p, ids).reason == "stop"
    assert check_stop(2, 1, "abc", 1, p, ids).text_end == 2  # an EOS id: its text is dropped
    assert check_stop(5, 1, "abc", 1, p, ids) is None
    assert check_stop(5, 4, "abc", 1, p, ids).reason == "length"
    hit = check_stop(5, 2, "abcEN" + "D!", 2, p, ids)
    assert (hit.reason, hit.text_end) == ("stop", 3)
    assert find_stop("..xy..END", 3, ["END", "xy"]) == 6  # only stops reaching the new characters count
    assert find_stop("..xy..END", 9, ["END", "xy"]) == 2  # earliest start wins


def make_seq(params):
    tok = byte_level_tokenizer()
    return Sequence("r", [65], params, None, tok.detokenizer([65]), frozenset(tok.stop_ids), None), tok


def test_stream_text_holds_back_a_possible_stop_string():
    seq, _ = make_seq(SamplingParams(max_tokens=50, stop=["STOP"]))
    pieces = [seq.append_token(b).text for b in b"abc STO"]
    assert "".join(pieces) == "abc "  # "STO" could start "STOP": held back
    assert stop_prefix_len("abc STO", ["STOP", "OX"]) == 3 and stop_prefix_len("abc STOX", ["STOP"]) == 0
    assert seq.append_token(ord("X")).text == "STOX"
    outs = []
    for b in b"yzSTOPmore":
        outs.append(seq.append_token(b))
        if outs[-1].finished:
            break
    assert len(outs) == 6 and outs[-1].finish_reason == "stop"
    assert seq.text == "abc STOXyz"
    assert "".join(pieces) + "STOX" + "".join(o.text for o in outs) == "abc STOXyz"


def test_stream_text_never_splits_a_character_and_eos_text_is_dropped():
    seq, tok = make_seq(SamplingParams(max_tokens=50))
    text = "".join(seq.append_token(b).text for b in "né€".encode())
    out = seq.append_token(tok.eos_token_id)
    assert text == "né€" and out.finished and out.finish_reason == "stop" and out.text == ""
    assert out.token_ids == [tok.eos_token_id]
