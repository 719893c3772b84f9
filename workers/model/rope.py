"""RoPE as Hugging Face checkpoints name it: the inverse frequencies of every supported scaling, the
context a scaling reaches, and where a checkpoint's rotary dimensions go in our layout.

Our layout is "rotate half" over the whole head: dimension j pairs with j + d/2 at frequency
inv_freq[j] (``layers.apply_rotary``, ``kernels.ops.rope_write``). Checkpoints that rotate only
part of the head (partial rotary) or pair (2i, 2i + 1) (GLM's interleaved rotary) are mapped onto
it by permuting the q and k rows of each head at load time (``head_dim_order``); the dimensions
that are not rotated get frequency 0 (cos 1, sin 0: passed through exactly). Attention scores are
q . k, which one common permutation of q's and k's dimensions leaves unchanged; v is not touched.

The arithmetic of each scaling follows transformers' ``modeling_rope_utils`` op for op in float32,
so the frequencies agree bit for bit (tests/workers/model/test_rope.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# rope_type -> keys its rope_scaling dict must carry (after ModelConfig.from_hf_config fills the
# defaults transformers derives: factor and original_max_position_embeddings).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("long_factor", "short_factor", "factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", "default")


def check_scaling(scaling: dict | None, rotary_dim: int) -> None:
    """ValueError naming an unsupported rope_type (with the supported list) or a missing key."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type ({kind!r}) is not supported; supported: {list(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED[kind] if (scaling or {}).get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling ({kind}) is missing {', '.join(missing)}")
    if kind == "longrope":
        for key in ("long_factor", "short_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ValueError(
                    f"rope_scaling.{key} has {len(scaling[key])} entries, the rotary dim "
                    f"{rotary_dim} needs {rotary_dim // 2}"
                )


def max_context(max_position_embeddings: int, scaling: dict | None) -> int:
    """Positions a model serves: config.json's ``max_position_embeddings``, or, for the scalings that
    stretch an original context (linear, dynamic, yarn), factor x that context where it is more.
    llama3 and longrope checkpoints already state their extended context as max_position_embeddings."""
    if rope_type(scaling) not in ("linear", "dynamic", "yarn"):
        return max_position_embeddings
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    return max(max_position_embeddings, int(scaling["factor"] * original))


def uses_long_factors(scaling: dict | None, positions: int) -> bool:
    """LongRoPE's choice between its factor sets, made once per model: long factors when the model
    serves more positions than its original context. transformers makes it per forward (long once
    the sequence is longer than that, recomputing the cache when it crosses); fixing it per model
    keeps every cached page's rotation the same whatever length its sequence reaches, so the two
    agree exactly for sequences past the original context (or models that stay within it)."""
    return rope_type(scaling) == "longrope" and positions > scaling["original_max_position_embeddings"]


def _default_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)  # [rot/2]


def rope_inv_freq(
    rotary_dim: int, rope_theta: float, rope_scaling: dict | None, long_factors: bool = False
) -> tuple[Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, attention factor) of a scaling.

    The attention factor multiplies cos and sin (so q . k by its square): YaRN's mscale, LongRoPE's
    sqrt(1 + ln(factor) / ln(original)); 1 for the others. ``dynamic`` returns the unscaled
    frequencies: its per-position ones come from ``dynamic_inv_freq``. ``long_factors``: which of
    LongRoPE's two factor sets (``uses_long_factors``).
    """
    check_scaling(rope_scaling, rotary_dim)
    kind = rope_type(rope_scaling)
    if kind == "yarn":
        return _yarn(rotary_dim, rope_theta, rope_scaling)
    if kind == "longrope":
        return _longrope(rotary_dim, rope_theta, rope_scaling, long_factors)
    inv_freq = _default_inv_freq(rotary_dim, rope_theta)
    if kind == "linear":
        inv_freq /= rope_scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    return inv_freq, 1.0


def dynamic_inv_freq(positions: Tensor, rotary_dim: int, rope_theta: float, scaling: dict) -> Tensor:
    """Dynamic NTK: positions [T] int -> inverse frequencies [T, rotary_dim // 2] float32, each
    token's from the base of a sequence one longer than its position (the unscaled base within the
    original context). transformers recomputes the base from the sequence length at every forward:
    a decoded token gets exactly this; a prompt longer than the original context gets one base for
    all its tokens there (the prompt's length), here each its own, so cached pages never depend on
    how long their sequence grew or how its prompt was chunked. No host synchronisation."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    seq_len = torch.clamp(positions.long() + 1, min=original)[:, None]  # [T, 1] int64
    base = rope_theta * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
    exponents = steps.float() / rotary_dim
    return 1.0 / (base**exponents[None, :])  # [T, rot/2]


def _yarn(rotary_dim: int, theta: float, scaling: dict) -> tuple[Tensor, float]:
    # Frequencies that turn fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those that turn more than beta_fast times kept, a linear ramp between.
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # [rot/2], 1 = extrapolate (keep the frequency)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(rotary_dim: int, theta: float, scaling: dict, long_factors: bool) -> tuple[Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(scaling["long_factor" if long_factors else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext * theta**exponents), attention_factor


def _llama3_scaled(inv_freq: Tensor, scaling: dict) -> Tensor:
    # inv_freq: [d/2] float32 -> [d/2]. Long wavelengths are divided by `factor`, short ones kept,
    # the band between them interpolated smoothly (transformers' _compute_llama3_parameters).
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def head_dim_order(head_dim: int, rotary_dim: int, interleaved: bool) -> list[int] | None:
    """Where a checkpoint's head dimensions go in our layout: our dimension j holds the checkpoint's
    dimension order[j]. None when the layouts agree (full rotary, rotate half).

    The checkpoint rotates its first ``rotary_dim`` dimensions, pairing i with i + rotary_dim / 2
    (rotate half) or 2i with 2i + 1 (interleaved), and passes the rest through. Pair i goes to our
    dimensions (i, i + d/2); the passed-through dimensions fill the slots of frequencies
    rotary_dim / 2 .. d/2 - 1 (frequency 0), first half then second half.
    """
    half, rot_half = head_dim // 2, rotary_dim // 2
    if interleaved:
        first, second = list(range(0, rotary_dim, 2)), list(range(1, rotary_dim, 2))
    else:
        first, second = list(range(rot_half)), list(range(rot_half, rotary_dim))
    passed = list(range(rotary_dim, head_dim))
    order = [*first, *passed[: half - rot_half], *second, *passed[half - rot_half :]]
    return None if order == list(range(head_dim)) else order
