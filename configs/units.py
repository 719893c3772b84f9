"""Token counts as people write them: 131072, 128K, 1M, 1.5K. K and M are powers of two (32K =
32,768 tokens, 1M = 1,048,576), as context lengths are quoted. One grammar for the typed config
(configs/schema.py: a YAML file may say `max_model_len: 128K`) and the command lines' token
arguments (cluster/measure/harness/sizes.py parse_tokens)."""

from __future__ import annotations

import re

TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def quantity(text: str, units: dict[str, int], what: str, shown: str) -> float:
    """A number with an optional unit of `units` (lower-case keys, matched case-insensitively; ""
    for none) times the unit's size. ValueError naming `what`, the text and the units as `shown`."""
    m = _QUANTITY.fullmatch(str(text))
    if m is None or m.group(2).lower() not in units:
        raise ValueError(f"{what} ({text!r}) must be a number with an optional unit {shown}")
    return float(m.group(1)) * units[m.group(2).lower()]


def token_count(text: str) -> int:
    """'128K' -> 131072; '1M' -> 1048576; '512' -> 512; '1.5K' -> 1536. ValueError naming the text
    unless it is a number with an optional K or M that makes a whole number of tokens."""
    value = quantity(text, TOKEN_UNITS, "token count", "K or M (powers of two: 128K = 131072)")
    if value != int(value):
        raise ValueError(f"token count ({text!r}) must be a whole number of tokens, not {value:g}")
    return int(value)


def token_text(value):
    """A pydantic before-validator: a string is a token count (`token_count`); anything else goes
    on unchanged to the field's own int validation."""
    return token_count(value) if isinstance(value, str) else value
