"""Token counts as people write them: 131072, 128K, 1M, 1.5K. K and M are powers of two (32K =
32,768 tokens, 1M = 1,048,576), as context lengths are quoted. One grammar for the typed config
(configs/schema.py: a YAML file may say `max_model_len: 128K`) and the command lines' token
arguments (cluster/measure/harness/sizes.py parse_tokens)."""

from __future__ import annotations

import re

TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}
_COUNT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def token_count(text: str) -> int:
    """'128K' -> 131072; '1M' -> 1048576; '512' -> 512; '1.5K' -> 1536. ValueError naming the text
    unless it is a number with an optional K or M that makes a whole number of tokens."""
    m = _COUNT.fullmatch(str(text))
    if m is None or m.group(2).lower() not in TOKEN_UNITS:
        raise ValueError(f"token count ({text!r}) must be a number with an optional unit K or M "
                         "(powers of two: 128K = 131072)")
    value = float(m.group(1)) * TOKEN_UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"token count ({text!r}) must be a whole number of tokens, not {value:g}")
    return int(value)


def token_text(value):
    """A pydantic before-validator: a string is a token count (`token_count`); anything else goes
    on unchanged to the field's own int validation."""
    return token_count(value) if isinstance(value, str) else value
