"""Hypothesis strategies for hostile request bodies, shared by the fuzz tests over the fake engine
(test_fuzz.py, many examples) and over the real one (test_real_engine.py, fewer).

A body is raw bytes: garbage, invalid UTF-8, truncated JSON, JSON that is not an object, or an
object built from the API's fields (and unknown ones) holding any JSON value: wrong types, huge
and negative numbers, NaN and infinities (Python's json accepts them), lone surrogates, nesting.
Valid-looking requests keep max_tokens small so the real engine answers in a moment.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "budget_tokens", "lockserve", "echo", "logprobs", "suffix",
    "best_of", "ignore_eos", "tools", "response_format", "unknown_field", "",
)
NUMBERS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63), 10**100]),
    st.floats(allow_nan=True, allow_infinity=True),
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\ud800", "\x00", "<|im_start|>", "é" * 30]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "robot"]), VALUES),
     "content": st.one_of(TEXT, VALUES, st.lists(st.fixed_dictionaries({"type": TEXT, "text": TEXT})))},
)
PROMPT = st.one_of(TEXT, st.lists(st.integers(-5, 400), max_size=12), st.lists(TEXT, max_size=3),
                   VALUES)
LOCKSERVE = st.one_of(VALUES, st.fixed_dictionaries({}, optional={
    "budget_tokens": NUMBERS, "tier": TEXT, "attention": st.sampled_from(["locks", "dense", "x"])}))


def _structured(max_tokens_cap: int) -> st.SearchStrategy[tuple[str, bytes]]:
    base = st.fixed_dictionaries(
        {},
        optional={"prompt": PROMPT, "messages": st.lists(MESSAGE, max_size=3), "lockserve": LOCKSERVE},
    )
    extra = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5)

    def build(path: str, body: dict, more: dict) -> tuple[str, bytes]:
        body = {**body, **more}
        for key in ("max_tokens", "max_completion_tokens"):  # keep real generations short
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 0:
                body[key] = min(body[key], max_tokens_cap)
        body.setdefault("max_tokens", max_tokens_cap)
        return path, json.dumps(body).encode()

    return st.builds(build, st.sampled_from(PATHS), base, extra)


def _raw() -> st.SearchStrategy[tuple[str, bytes]]:
    garbage = st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b'{"prompt": "x",', b"[1, 2]", b"null", b'"text"', b"\xff\xfe{}",
                         b'{"prompt": "\xc3"}', b'{"prompt": NaN}', b"{" * 5000]),
        VALUES.map(lambda v: json.dumps(v).encode()),
    )
    return st.tuples(st.sampled_from(PATHS), garbage)


def request_bodies(max_tokens_cap: int = 8) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body bytes) of a hostile or valid-looking request."""
    return st.one_of(_raw(), _structured(max_tokens_cap))
