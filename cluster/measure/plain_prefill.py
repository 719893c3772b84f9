"""The plain torch prefill anchor: what a one-shot prefill of a model's shape costs in plain torch.

`lockserve bench prefill` runs it beside the engine in the same process, so the engine's prefill
time has a reference measured on the same device at the same moment. The stack is embedding-free
and has no LM head: a random hidden state [T, hidden] goes through ``num_layers`` of

    RMSNorm -> fused QKV -> RoPE -> flash SDPA (causal, GQA native) -> O -> + residual
            -> RMSNorm -> SwiGLU (fused gate/up, silu(gate) * up, down) -> + residual

with random weights (normal, std 0.02; norm weights ones). Attention is one call per layer over
the whole sequence; nothing is paged, cached or chunked.

    python -m lockserve.cluster.measure.plain_prefill --model llama-3.1-8b --tokens 32768 131072
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lockserve.workers.model.model import ModelConfig
from lockserve.workers.model.presets import PRESETS
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "PlainPrefill",
    "causal_gqa_attention",
    "main",
    "prefill_flops",
    "time_plain_prefill",
]

# NOTE: the projections and the MLP run over slices of at most this many tokens, which bounds
# their activations (a [65536, 2 * 14336] bf16 gate/up is 3.8 GB for Llama-3.1-8B); attention
# still sees the whole sequence in one call, so the slicing changes no FLOP and no result.
SLICE_TOKENS = 65536
# A CPU warm-up is skipped above this many tokens: it would double a run that is already slow.
CPU_WARMUP_MAX_TOKENS = 4096
# Past this many tokens a prefill is timed once, after a warm-up of one slice (the projections'
# GEMMs at the slices' shape, flash SDPA's kernel): at 128K two timed runs differ by 0.1%
# (seconds_all in the committed prefill files), and a full-length warm-up plus two runs of 512K at
# GLM-4-9B-Chat-1M's shape (~3 min each) outlive a 10-minute device call.
LONG_TOKENS = 262144
WEIGHT_STD = 0.02
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def prefill_flops(cfg: ModelConfig, tokens: int, prefix: int = 0) -> float:
    """FLOPs of prefilling ``tokens`` new tokens after ``prefix`` cached ones (no embedding, no LM head).

    With hidden size D, intermediate size I, L layers, Hq query heads, Hkv KV heads, head dim d,
    n = tokens and p = prefix (a multiply-add counts as 2 FLOPs):

        linear    = 2 * n * L * (D * (Hq + 2 * Hkv) * d + Hq * d * D + 3 * D * I)
        attention = 4 * d * Hq * L * (n * p + n * (n + 1) / 2)

    The linear term is q/k/v/o and gate/up/down once per new token. The attention term is QK^T and
    PV (2 * d FLOPs each per query head and visible key) summed over the causal pattern: new query
    i (1-based) sees the p cached keys and i new ones. Llama-3.1-8B at n = 131072, p = 0: 6.33e15.
    """
    if tokens < 0 or prefix < 0:
        raise ValueError(f"tokens ({tokens}) and prefix ({prefix}) must be >= 0")
    hidden, heads, kv_heads, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn_weights = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden
    mlp_weights = 3 * hidden * cfg.intermediate_size
    linear = 2 * tokens * (attn_weights + mlp_weights) * cfg.num_layers
    visible_keys = tokens * prefix + tokens * (tokens + 1) // 2  # exact: n (n + 1) is even
    attention = 4 * d * heads * visible_keys * cfg.num_layers
    return float(linear + attention)


def causal_gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v for one sequence, GQA native (no K/V repeat).

    q: [T, Hq, d]; k, v: [T, Hkv, d] with Hq a multiple of Hkv; query head h reads KV head
    h // (Hq // Hkv). Returns [T, Hq, d] in q's dtype. On CUDA only cuDNN's or flash's kernel may run: a
    RuntimeError names the shapes and dtype when no fused kernel can (rather than timing the math).
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [T, Hq, d], k/v [T, Hkv, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, d], last dim dense
    if q.device.type == "cuda":
        out = _flash_sdpa(qh, kh, vh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [T, Hq, d]


def _flash_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # q: [1, Hq, T, d], k/v: [1, Hkv, T, d] -> [1, Hq, T, d]: the fastest fused kernel torch has,
    # cuDNN's, then FlashAttention-2 (on the H200 cuDNN ran 1.8 x faster:
    # docs/results/prefill_attention_probe_h200.json); never the unfused math.
    errors = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            errors.append(f"{backend.name}: {error}")
    raise RuntimeError(f"no fused SDPA kernel for q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype} on "
                       f"{q.device} (cuDNN or flash need fp16/bf16, head_dim <= 128/256, sm80+): {errors}")


@dataclass
class PlainLayer:
    """One decoder layer's weights, stored [in, out] so a projection is ``x @ w``."""

    attn_norm: Tensor  # [hidden]
    w_qkv: Tensor  # [hidden, (Hq + 2 Hkv) d]
    w_o: Tensor  # [Hq d, hidden]
    mlp_norm: Tensor  # [hidden]
    w_gate_up: Tensor  # [hidden, 2 I], gate columns first
    w_down: Tensor  # [I, hidden]


class PlainPrefill:
    """A random-weight, embedding-free Llama stack that prefills [T, hidden] in one shot.

    ``stack(hidden) -> [T, hidden]`` (the residual stream after the last layer, no final norm);
    the input is not modified. Positions are 0 .. T-1; RoPE is plain rotate-half with
    ``cfg.rope_theta`` (``rope_scaling`` only changes angle values, not the cost, and is ignored).
    """

    def __init__(self, cfg: ModelConfig, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 slice_tokens: int = SLICE_TOKENS):
        if slice_tokens <= 0:
            raise ValueError(f"slice_tokens ({slice_tokens}) must be > 0")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.slice_tokens = slice_tokens
        generator = torch.Generator(self.device).manual_seed(seed)
        self.layers = [self._random_layer(generator) for _ in range(cfg.num_layers)]

    def _random_layer(self, generator: torch.Generator) -> PlainLayer:
        cfg = self.cfg
        hidden, d = cfg.hidden_size, cfg.head_dim
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        return PlainLayer(
            attn_norm=self._ones(hidden),
            w_qkv=self._normal(generator, hidden, qkv_width),
            w_o=self._normal(generator, cfg.num_heads * d, hidden),
            mlp_norm=self._ones(hidden),
            w_gate_up=self._normal(generator, hidden, 2 * cfg.intermediate_size),
            w_down=self._normal(generator, cfg.intermediate_size, hidden),
        )

    def _normal(self, generator: torch.Generator, *shape: int) -> Tensor:
        out = torch.empty(shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, WEIGHT_STD, generator=generator)

    def _ones(self, size: int) -> Tensor:
        return torch.ones(size, device=self.device, dtype=self.dtype)

    def random_hidden(self, tokens: int, seed: int = 0) -> Tensor:
        """A random input hidden state [tokens, hidden] (normal, std 1) in the stack's dtype."""
        generator = torch.Generator(self.device).manual_seed(seed)
        out = torch.empty(tokens, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, 1.0, generator=generator)

    @torch.inference_mode()
    def __call__(self, hidden: Tensor) -> Tensor:
        # hidden: [T, hidden] -> [T, hidden]
        x = hidden.clone()  # [T, hidden], the residual stream, updated in place
        cos, sin = rope_cos_sin(x.shape[0], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            o = causal_gqa_attention(q, k, v).flatten(1)  # [T, Hq d]
            del q, k, v
            self._output_and_mlp(layer, x, o)
        return x

    def attention_inputs(self, layer: PlainLayer, x: Tensor, cos: Tensor, sin: Tensor):
        """Post-RoPE (q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]) of ``x`` [T, hidden] for a layer."""
        cfg, tokens = self.cfg, x.shape[0]
        q = x.new_empty(tokens, cfg.num_heads, cfg.head_dim)
        k = x.new_empty(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = torch.empty_like(k)
        for s in self._slices(tokens):
            qkv = rms_norm(x[s], layer.attn_norm, cfg.rms_norm_eps) @ layer.w_qkv  # [S, (Hq + 2 Hkv) d]
            qs, ks, vs = qkv.unflatten(1, (-1, cfg.head_dim)).split(
                [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            q[s] = apply_rope(qs, cos[s], sin[s])
            k[s] = apply_rope(ks, cos[s], sin[s])
            v[s] = vs
        return q, k, v

    def _output_and_mlp(self, layer: PlainLayer, x: Tensor, o: Tensor) -> None:
        # x: [T, hidden] updated in place; o: [T, Hq d] the attention output
        for s in self._slices(x.shape[0]):
            x[s] += o[s] @ layer.w_o
            gate, up = (rms_norm(x[s], layer.mlp_norm, self.cfg.rms_norm_eps) @ layer.w_gate_up).chunk(2, -1)
            x[s] += (F.silu(gate) * up) @ layer.w_down  # gate, up: [S, I]

    def _slices(self, tokens: int) -> list[slice]:
        step = self.slice_tokens
        return [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / rms(x) over the last dim, the mean of squares in float32; x: [S, hidden]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_cos_sin(tokens: int, head_dim: int, theta: float, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [tokens, head_dim] for positions 0 .. tokens-1, rotate-half layout, float32 angles."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * inv_freq  # [T, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [S, H, d] rotated by position: x * cos + rotate_half(x) * sin, cos/sin [S, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [S, H, d]
    return x * cos[:, None] + rotated * sin[:, None]


def time_plain_prefill(cfg: ModelConfig, tokens: int, device, dtype: torch.dtype = torch.bfloat16,
                       repeats: int = 2, seed: int = 0) -> dict:
    """Time one-shot plain prefills of ``tokens`` tokens: one warm-up, then ``repeats`` timed runs
    (one past LONG_TOKENS, after a warm-up of one slice).

    Returns {"tokens", "seconds" (the fastest run), "seconds_all" (every timed run), "flops"
    (prefill_flops), "tflops" (flops / seconds / 1e12), "warmup_tokens" (0: none)}. The warm-up is
    skipped on the CPU above CPU_WARMUP_MAX_TOKENS. Weights and activations are freed before returning.
    """
    if tokens <= 0 or repeats <= 0:
        raise ValueError(f"tokens ({tokens}) and repeats ({repeats}) must be > 0")
    device = torch.device(device)
    stack = PlainPrefill(cfg, device, dtype, seed)
    hidden = stack.random_hidden(tokens, seed)  # [T, hidden]
    long = tokens > LONG_TOKENS
    warmup = 0 if device.type != "cuda" and tokens > CPU_WARMUP_MAX_TOKENS else \
        min(tokens, SLICE_TOKENS) if long else tokens
    if warmup:
        _timed_run(stack, hidden[:warmup])
    seconds_all = [_timed_run(stack, hidden) for _ in range(1 if long else repeats)]
    del stack, hidden
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flops = prefill_flops(cfg, tokens)
    seconds = min(seconds_all)
    return {"tokens": tokens, "seconds": seconds, "seconds_all": seconds_all,
            "tflops": flops / seconds / 1e12, "flops": flops, "warmup_tokens": warmup}


def _timed_run(stack: PlainPrefill, hidden: Tensor) -> float:
    cuda = hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(hidden.device)
    start = time.perf_counter()
    out = stack(hidden)
    if cuda:
        torch.cuda.synchronize(hidden.device)
    seconds = time.perf_counter() - start
    del out
    return seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS), help="shape preset")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="token counts to prefill")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per token count (after a warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Time the plain prefill at each --tokens count; print one line each, optionally write JSON."""
    args = parse_args(argv)
    cfg, dtype = PRESETS[args.model], DTYPES[args.dtype]
    results = []
    for tokens in args.tokens:
        r = time_plain_prefill(cfg, tokens, args.device, dtype, args.repeats)
        results.append(r)
        print(f"{args.model} tokens={tokens} seconds={r['seconds']:.4f} tflops={r['tflops']:.1f} "
              f"flops={r['flops']:.3e}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"model": args.model, "device": args.device, "dtype": args.dtype, "results": results}
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
