"""The engine's attention backend: the step plan, its builder, and the per-layer impl.

Roles (as in vLLM's backends): `StepPlan` is what one forward attends (built once per step by
`plan_step`, or once per CUDA graph: a decode-only plan reads nothing but views of the
persistent `DecodeState`); `PagedAttention.__call__(layer, qkv, rope)` runs once per layer with
no host synchronisation (on host+nvme a selected page still on NVMe is recorded as missed and
the forward runs again after its promotion: offload/spilled.py).

A step's tokens are decode tokens first (one per decode row, in row order), then prefill chunks.
Per layer:
1. RoPE on q and k, and every new token's K/V into its page in the write pool (one kernel);
2. decode: per (row, KV head) select pages - every page (dense, or a row whose pages fit its
   budget) or the sink, the recent pages and the best by LOCKS score from the summaries; on a
   sliding-window layer (QKV.window) the pages of the window, its start masked, never scored -
   and attend them exactly in one kernel: full pages from the tier (through the hot-page cache on
   host tiers), the open page from the write pool (one attention pool holds both);
3. prefill: exact causal attention of the chunk over all of its sequence's pages, gathered where
   they are in HBM (the arena on hbm; the prefill window on host tiers, so a chunk never reads
   its own prefix back over PCIe) into one flash-attention call with GQA native.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from lockserve.kernels import merge_partials, ops
from lockserve.kernels.score import PageScores
from lockserve.kernels.select import DecodeRows, DecodeSelection, PoolAddress, window_selection, window_width
from lockserve.kernels.triton.prefill import BLOCK_N as PREFILL_BLOCK_N
from lockserve.kernels.triton.select import DEFAULT_RADIX_BITS, check_radix_bits
from lockserve.workers.model.layers import QKV

from .kv_manager import KVManager, PrefixView, page_slots
from .scheduler import Batch
from .uploads import upload

ATTENTION_MODES = ("dense", "locks")

# "auto": kernels.ops (CUDA / Triton) on CUDA, the torch reference on CPU - the Triton interpreter
# is for kernel tests, far too slow for an engine. "ops": always kernels.ops (which itself runs
# Triton where it can, i.e. on CPU only under TRITON_INTERPRET=1). "reference": always the reference.
KERNEL_CHOICES = ("auto", "ops", "reference")


def use_ops(kernels: str, t: torch.Tensor) -> bool:
    return kernels == "ops" or (kernels == "auto" and t.is_cuda)


@dataclass
class PrefillMeta:
    """One prefill chunk: tokens [token_start, token_start + num_tokens) of the step; the sequence
    has `length` tokens after it. Its pages up to the chunk's last are settled_pids: [S] its first
    S pages, read from the tier, then locs: [U] write-pool locations of the rest (the prefill
    window's pages and the chunk's own; KVManager.prefix)."""

    token_start: int
    num_tokens: int
    length: int
    settled_pids: torch.Tensor
    locs: torch.Tensor


@dataclass
class StepPlan:
    """What one forward attends. num_decode rows read `rows` (views of the DecodeState) and the
    LOCKS scores of their first `width` pages; k: selection width (>= every row's pages taken);
    scored: score the pages (False: every page). write_loc, write_off: [T] where each token's K/V
    goes (decodes: the rows' tail_loc / tail_off views). num_settled: [num_decode]."""

    num_decode: int
    rows: DecodeRows | None
    num_settled: torch.Tensor | None
    k: int
    scored: bool
    prefills: list[PrefillMeta]
    write_loc: torch.Tensor
    write_off: torch.Tensor


def window_pages(windows, page_size: int) -> int:
    """Pages one decode row of the widest sliding-window layer reads (windows: a window or None per
    layer, ModelConfig.layer_windows); 0 without one. A tier's decode read buffer must hold them
    whatever the LOCKS budget (window layers are never pruned)."""
    return max((window_width(w, page_size) for w in windows if w is not None), default=0)


def pid_tensor(seq, device: torch.device) -> torch.Tensor:
    """The sequence's page ids on the device, [len(pids)] int64, made once: pids are fixed from
    admission to the end, and a long context has tens of thousands of them."""
    if seq.pid_tensor is None:
        seq.pid_tensor = upload(seq.pids, dtype=torch.int64, device=device)
    return seq.pid_tensor


def decode_plan(state, n: int, width: int, k: int, scored: bool) -> StepPlan:
    """A decode-only plan over rows 0..n-1 of a DecodeState: views only (graph capturable)."""
    return StepPlan(n, state.rows(n, width), state.field("num_settled", n), k, scored, [],
                    state.field("tail_loc", n), state.field("tail_off", n))


def plan_step(batch: Batch, locs: list[list[int]], page_size: int, state, scored: bool,
              device: torch.device, prefixes: list[PrefixView] | None = None) -> StepPlan:
    """The plan of an eager step: decode rows from `state` (staged for this step), then prefill
    chunks with their write locations uploaded (locs: KVManager.plan of each chunk). prefixes:
    KVManager.prefix of each prefill chunk (None: its settled pages from the tier, its own pages
    from the write pool)."""
    nd = len(batch.decodes)
    width = state.max_pages_of(nd)
    k = width if not scored else state.max_selected_of(nd)
    plan = decode_plan(state, nd, max(width, 1), max(k, 1), scored)
    write_loc, write_off, prefills, start = [], [], [], nd
    if prefixes is None:
        prefixes = [PrefixView(c.start // page_size, chunk_locs)
                    for c, chunk_locs in zip(batch.prefills, locs[nd:], strict=True)]
    for chunk, chunk_locs, prefix in zip(batch.prefills, locs[nd:], prefixes, strict=True):
        first = chunk.start // page_size
        for t in range(chunk.start, chunk.end):
            write_loc.append(chunk_locs[t // page_size - first])
            write_off.append(t % page_size)
        settled = pid_tensor(chunk.seq, device)[: prefix.tier_pages]
        prefills.append(PrefillMeta(start, chunk.num_tokens, chunk.end, settled,
                                    upload(prefix.locs, dtype=torch.int64, device=device)))
        start += chunk.num_tokens
    if prefills:
        plan.prefills = prefills
        loc, off = upload(write_loc, dtype=torch.int64, device=device), upload(write_off, dtype=torch.int64,
                                                                                 device=device)
        plan.write_loc = torch.cat([plan.write_loc.long(), loc])
        plan.write_off = torch.cat([plan.write_off.long(), off])
    return plan


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: int | None = None) -> torch.Tensor:
    """Exact causal attention of a sequence's last n tokens over all its L keys (L >= n).

    q: [n, Hq, d]; keys, values: [L, Hkv, d] -> o [n, Hq, d] in q's dtype; query i sits at
    position p = L - n + i (the mask is aligned to the bottom right); with a sliding ``window`` W
    it sees only keys p - W + 1 .. p (`_windowed_prefill`). Never an [Hq, n, L] score matrix
    (but for windowed layers off CUDA, see there). On CUDA in fp16/bf16 (`fast_prefill_applies`):
    cuDNN's fused attention, the cached prefix unmasked in fixed key blocks and the chunk causal,
    merged by log-sum-exp (`_cudnn_prefill`; 1.8 x FlashAttention-2 on the H200:
    docs/results/prefill_attention_probe_h200.json), or one FlashAttention-2 call for short chunks
    and where cuDNN's is missing; both with GQA native (K/V never repeated to the query heads
    where the kernel takes it). On CPU two flash calls split and merged as on CUDA (CPU SDPA would
    materialise a lower-right bias), the prefix's K/V not repeated (`_split_flash`); otherwise K/V
    repeated per group and SDPA with a lower-right causal bias (the memory-efficient kernel).
    """
    if window is not None:
        lo = max(0, keys.shape[0] - q.shape[0] - window + 1)  # the first key any query sees
        keys, values = keys[lo:], values[lo:]
        if window < keys.shape[0]:  # else the window holds every key left: plain causal
            return _windowed_prefill(q, keys, values, window)
    if fast_prefill_applies(q, keys):
        if _cuda_cudnn is not None and q.shape[-1] <= 128:
            return _cudnn_prefill(q, keys, values)
        return _flash_prefill(q, keys, values)
    if q.device.type == "cpu" and _cpu_flash is not None:
        return _split_flash(q, keys, values)[0].transpose(0, 1).to(q.dtype)
    n, hq, _ = q.shape
    length, hkv = keys.shape[0], keys.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
    kh = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]  # [1, Hq, L, d]
    vh = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
    # Imported here: torch.nn.attention.bias pulls in torch._dynamo (about 1 s in every process
    # that imports the engine, CPU workers included, which never come here).
    from torch.nn.attention.bias import causal_lower_right

    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, length))
    return o[0].transpose(0, 1).to(q.dtype)


def _windowed_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int) -> torch.Tensor:
    # q: [n, Hq, d]; keys, values: [L, Hkv, d], L <= n + window - 1 (prefill_attention drops the
    # keys no query sees) -> [n, Hq, d]. On CUDA (fast_prefill_applies): one FlashAttention-2 call
    # with window_size_left = W - 1 (FA2 keeps key j for query i when i + L - n - j <= left: W keys,
    # the query's own included). Elsewhere a masked reference: SDPA with a boolean [n, L] mask,
    # K/V repeated per group (O(n (n + W)) mask bytes: a chunk at a time, fine for CPU tests).
    n, hq, _ = q.shape
    length, hkv = keys.shape[0], keys.shape[1]
    if fast_prefill_applies(q, keys):
        out = _cuda_flash(q[None], keys[None], values[None], None, None, n, length, 0.0, True, False,
                          window_size_left=window - 1, window_size_right=0)[0]
        return out[0]
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]  # [n, 1]
    key_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
    seen = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [n, L]
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
    kh = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]  # [1, Hq, L, d]
    vh = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen)
    return o[0].transpose(0, 1).to(q.dtype)


_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_cuda_flash = getattr(torch.ops.aten, "_flash_attention_forward", None)
_cuda_cudnn = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
FAST_DTYPES = (torch.float16, torch.bfloat16)


def fast_prefill_applies(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes a fused CUDA kernel (fp16/bf16, head_dim a multiple of 8
    up to 256 (cuDNN's up to 128), a whole number of query heads per KV head)."""
    d = q.shape[-1]
    return (_cuda_flash is not None and q.is_cuda and q.dtype in FAST_DTYPES and keys.dtype == q.dtype
            and d % 8 == 0 and d <= 256 and q.shape[1] % keys.shape[1] == 0)


def prefill_backend(device: torch.device) -> str:
    """The kernel `prefill_attention` runs on this device, for result files."""
    if device.type != "cuda":
        return "cpu flash (split, merged)" if _cpu_flash is not None else "sdpa lower-right bias"
    gqa = "GQA native" if _CUDNN_GQA[0] is not False else "K/V repeated"
    return f"cudnn (split, merged; {gqa})" if _cuda_cudnn is not None else "flash-attention-2 (GQA native)"


def _flash_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # q: [n, Hq, d]; keys, values: [L, Hkv, d] -> [n, Hq, d]. NOTE: FlashAttention-2 aligns its
    # causal mask to the bottom right when n < L (query i sees keys 0 .. L - n + i), which is the
    # chunk-over-prefix mask; SDPA's is_causal is top-left, so SDPA never sends this case to flash.
    n, length = q.shape[0], keys.shape[0]
    out = _cuda_flash(q[None], keys[None], values[None], None, None, n, length, 0.0, True, False)[0]
    return out[0]


# Whether cuDNN's op took K/V with fewer heads than q on this process's GPU (None: not tried yet).
# NOTE: a capability of the torch/cuDNN build, found once at the first prefill; never changes after.
_CUDNN_GQA: list[bool | None] = [None]
# cuDNN builds an execution plan for every new shape (55-80 ms on the H200, more the first time:
# docs/results/prefill_attention_first_calls_h200.json), and a chunked prefill meets a new prefix
# length every chunk. So cuDNN attends only key blocks of these fixed sizes (a prefix is cut into
# them, largest first: a few shapes, planned once per chunk size) and the chunk itself (causal,
# square); the prefix's remainder goes to FlashAttention-2, which plans nothing. Chunks of fewer
# than CUDNN_MIN_QUERIES queries (a warm request's tail, a step beside decodes) run FA2 whole.
CUDNN_KEY_BLOCKS = (65536, 32768, 16384, 8192)
CUDNN_MIN_QUERIES = 1024
# Chunks of at most this many queries (a warm request's tail, a step beside decodes, a prompt's
# last chunk) run kernels.ops.paged_prefill: where every page of the prefix is in the write pool
# (every chunk on hbm; on host tiers while the prefill window holds the prefix) it reads them where
# they lie, no gather; otherwise over the gathered pages (pool layout, no flash-layout copy). Both
# cases take one kernel, so a warm tail's bits equal the cold chunk's (kernels/triton/prefill.py
# _splits). A short chunk over a long prefix is bound by reading the prefix's K/V, which the gather
# path reads three times and writes twice: on the H100 (scripts/paged_prefill_probe.py at 843fd94,
# its file not kept), one 8B layer at a 128K prefix, 16 queries 0.42 ms against 1.73, 64: 0.83
# against 1.74, 256: 2.81 against 2.97 (even), 1,023: 9.4 against 7.3 (slower); at 8K, 256 queries
# already 0.86 x. The kernel alone under its launch knobs: docs/results/paged_prefill_tune_h100.json.
PAGED_PREFILL_MAX_QUERIES = 128


def _cudnn_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   min_queries: int = CUDNN_MIN_QUERIES) -> torch.Tensor:
    # q: [n, Hq, d]; keys, values: [L, Hkv, d] -> [n, Hq, d]: the prefix's L - n keys unmasked (in
    # fixed blocks through cuDNN, the remainder through FA2) and the chunk's n causal (square, so
    # top-left = bottom-right), each with its LSE, merged. Chunks of fewer than min_queries run FA2
    # whole (scripts/paged_prefill_probe.py lowers it to time cuDNN on short chunks).
    n, hq, _ = q.shape
    length, hkv = keys.shape[:2]
    if n < min_queries:
        return _flash_prefill(q, keys, values)
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
    kh, vh = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hkv, L, d]
    if hkv != hq and _CUDNN_GQA[0] is None:
        try:
            _cudnn_part(qh, kh[:, :, :1], vh[:, :, :1], False)
            _CUDNN_GQA[0] = True
        except RuntimeError:
            _CUDNN_GQA[0] = False
    if hkv != hq and not _CUDNN_GQA[0]:
        kh, vh = kh.repeat_interleave(hq // hkv, dim=1), vh.repeat_interleave(hq // hkv, dim=1)
    prefix, start, parts = length - n, 0, []
    for block in CUDNN_KEY_BLOCKS:
        while prefix - start >= block:
            keys_block = slice(start, start + block)
            parts.append(_cudnn_part(qh, kh[:, :, keys_block], vh[:, :, keys_block], False))
            start += block
    if start < prefix:  # fewer keys than the smallest block: FA2, unmasked
        out = _cuda_flash(q[None], keys[None, start:prefix], values[None, start:prefix], None, None, n,
                          prefix - start, 0.0, False, False)
        parts.append((out[0].transpose(1, 2), out[1].view(qh.shape[:3])))
    parts.append(_cudnn_part(qh, kh[:, :, prefix:], vh[:, :, prefix:], True))
    if len(parts) == 1:
        return parts[0][0][0].transpose(0, 1).to(q.dtype)
    o, _ = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    return o[0].transpose(0, 1).to(q.dtype)


def _cudnn_part(qh, kh, vh, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # qh: [1, Hq, n, d]; kh, vh: [1, H, m, d] -> (o [1, Hq, n, d], lse [1, Hq, n] float32)
    out = _cuda_cudnn(qh, kh, vh, None, True, 0.0, causal, False)
    return out[0], out[1].view(qh.shape[:3])


def _split_flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # q: [n, Hq, d]; keys, values: [L, Hkv, d], L >= n -> [1, Hq, n, d]. CPU flash twice, merged by
    # log-sum-exp: the chunk's own n keys causal (K/V repeated per group: n x n, small), and the
    # prefix unmasked with a group's G query heads folded into the query axis ([1, Hkv, G n, d]:
    # without a mask the rows are independent, so the prefix's K/V are read per KV head, never
    # repeated; they were G x the bytes at every chunk and layer).
    n, hq, d = q.shape
    length, hkv = keys.shape[:2]
    g, prefix = hq // hkv, length - n
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
    kc, vc = (t[prefix:].transpose(0, 1).repeat_interleave(g, dim=0)[None] for t in (keys, values))
    o_chunk, lse_chunk = _cpu_flash(qh, kc, vc, is_causal=True)[:2]  # [1, Hq, n, d], [1, Hq, n]
    if prefix == 0:
        return o_chunk
    qg = q.reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)  # query head = kv g + j
    kp, vp = (t[None, :prefix].transpose(1, 2) for t in (keys, values))  # [1, Hkv, prefix, d]
    o_prefix, lse_prefix = _cpu_flash(qg, kp, vp)[:2]  # [1, Hkv, G n, d], [1, Hkv, G n]
    o_prefix, lse_prefix = o_prefix.reshape(1, hq, n, d), lse_prefix.reshape(1, hq, n)
    o, _ = merge_partials(torch.stack([o_prefix, o_chunk]), torch.stack([lse_prefix, lse_chunk]))
    return o


@dataclass(frozen=True)
class DecodeTrace:
    """What one decode layer selected, handed to `PagedAttention.observer` (instrumentation).

    layer; q: [Bd, Hq, d] after RoPE; scores: the PageScores the selection read (None: every page
    attended, or a sliding-window layer); selection: slots, lens, is_open, idx [Bd, Hkv, K] and,
    on a window layer, first_start [Bd, Hkv] (kernels.select.DecodeSelection); rows: the decode
    rows (page_table [Bd, P], num_pages, budgets, tail_len, tail_loc [Bd]); num_settled: [Bd] full
    (scored) pages; window: the layer's sliding window (None: a global layer). Views of live
    tensors: copy what must outlive the call.
    """

    layer: int
    q: torch.Tensor
    scores: PageScores | None
    selection: DecodeSelection
    rows: DecodeRows
    num_settled: torch.Tensor
    window: int | None = None

    def tokens_attended(self) -> torch.Tensor:
        """[Bd, Hkv] int64: keys each (row, KV head) attended (the window's masked start left out)."""
        tokens = self.selection.lens.long().sum(dim=-1)
        start = self.selection.first_start
        return tokens if start is None else tokens - start.long()


class PagedAttention:
    """Implements the model's AttentionFn over the engine's paged KV (see the module docstring).

    sink_pages / recent_pages: pages LOCKS always selects (recent_pages >= 1 keeps the open
    page, which has no summary yet, always selected). kernels: one of KERNEL_CHOICES.
    selector: scores the pages instead of LOCKS's summaries (engine/selectors.py; None: LOCKS from
    kv.summaries, the decode hot path). observer: when set, called with a DecodeTrace after every
    decode layer's selection (eager steps only: a replayed CUDA graph calls no Python, and a step
    being captured must not be observed; engines that observe are built with use_graphs False).
    radix_bits: bits a pass of the Triton selection's threshold search fixes (kernels/triton/select.py
    RADIX_BITS_CHOICES; the same pages either way).
    """

    def __init__(self, kv: KVManager, sink_pages: int = 1, recent_pages: int = 2, kernels: str = "auto",
                 selector=None, radix_bits: int = DEFAULT_RADIX_BITS):
        if recent_pages < 1:
            raise ValueError(f"recent_pages ({recent_pages}) must be >= 1: the open page has no summary")
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels ({kernels!r}) must be one of {KERNEL_CHOICES}")
        check_radix_bits(radix_bits)
        self.kv, self.kernels, self.radix_bits = kv, kernels, radix_bits
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.fast = use_ops(kernels, kv.attn_pool)
        # kernels.ops backend: the CUDA / Triton kernels on a GPU, Triton's interpreter when "ops"
        # is asked for on CPU (kernel tests), the torch reference otherwise.
        self.backend = "torch" if not self.fast else "auto" if kv.attn_pool.is_cuda else "triton"
        self.plan: StepPlan | None = None
        self.selector = selector
        self.observer = None  # Callable[[DecodeTrace], None] | None

    def bind(self, plan: StepPlan) -> None:
        self.plan = plan

    def __call__(self, layer: int, x: QKV) -> torch.Tensor:
        # x: the layer's fused projection before RoPE (QKV) -> o [T, Hq, d]
        plan, kv = self.plan, self.kv
        q = ops.rope_write(x.qkv, x.cos, x.sin, x.num_heads, x.num_kv_heads, kv.write_pool, plan.write_loc,
                           plan.write_off, layer * kv.write_rows, backend=self.backend)  # [T, Hq, d]
        out = []
        if plan.num_decode:
            out.append(self._decode(layer, q[: plan.num_decode], x.window))
        for p in plan.prefills:
            out.append(self._prefill(layer, q[p.token_start : p.token_start + p.num_tokens], p, x.window))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _scores(self, layer: int, q: torch.Tensor) -> PageScores | None:
        """Scores of the first `width` pages and their normalisers, or None when every page is
        attended."""
        plan = self.plan
        if not plan.scored:
            return None
        if self.selector is not None:
            return self.selector.scores(layer, q, plan.rows.page_table, plan.num_settled, self.backend)
        table = self.kv.summaries.layers[layer]
        return ops.score_stats(q, table, plan.rows.page_table, plan.num_settled, backend=self.backend)

    def _decode(self, layer: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
        # q: [Bd, Hq, d] -> o [Bd, Hq, d] in q's dtype (cast in the attention kernel's store).
        # NOTE: a sliding-window layer (window W) attends its last W keys exactly, never a LOCKS
        # selection: the pages overlapping the window (kernels.select.window_selection), the tokens
        # of the first before the window masked. On CUDA that first page goes through the torch
        # reference, merged with the Triton kernel's pass over the rest (ops.sparse_decode), since
        # the kernel masks only the ends of pages.
        plan, kv, lay = self.plan, self.kv, self.kv.layout
        where = PoolAddress(layer * lay.max_pages, kv.write_front, layer * kv.write_rows)
        if window is not None:
            scores = None
            sel = window_selection(plan.rows, window, lay.num_kv_heads, lay.page_size, where)
        else:
            scores = self._scores(layer, q)
            args = (scores, plan.rows, plan.k, self.sink_pages, self.recent_pages, lay.num_kv_heads,
                    lay.page_size, where)
            sel = ops.decode_selection(*args, backend=self.backend, radix_bits=self.radix_bits)
        if self.observer is not None:
            self.observer(DecodeTrace(layer, q, scores, sel, plan.rows, plan.num_settled, window))
        if kv.settled.lookahead and scores is not None:  # host+nvme: what the next step may select
            self._look_ahead(layer, scores, args[3:])
        idx = kv.resolve(sel)  # [Bd, Hkv, K] attention-pool indices
        o, _ = ops.sparse_decode(q, kv.attn_pool, idx, sel.lens, backend=self.backend, out_dtype=q.dtype,
                                 first_start=sel.first_start)
        return o

    def _look_ahead(self, layer: int, scores: PageScores, rest: tuple) -> None:
        """The selection at `lookahead` x each row's budget, recorded for the tier's prefetch."""
        plan, n = self.plan, self.kv.settled.lookahead
        wide = replace(plan.rows, budgets=plan.rows.budgets * n)
        ahead = ops.decode_selection(scores, wide, n * plan.k, *rest, backend=self.backend,
                                     radix_bits=self.radix_bits)
        self.kv.settled.note_ahead(layer, ahead.slots)

    def _prefill(self, layer: int, q: torch.Tensor, p: PrefillMeta, window: int | None) -> torch.Tensor:
        # q: [n, Hq, d] -> o [n, Hq, d]: causal over the sequence's `p.length` tokens (the last
        # `window` of them for each query on a sliding-window layer). NOTE: every page of the
        # prefix is still gathered on a window layer; prefill_attention drops the keys before it.
        kv = self.kv
        if self.fast and window is None and p.num_tokens <= PAGED_PREFILL_MAX_QUERIES:
            if not p.settled_pids.numel():  # every page of the prefix in the write pool
                pool, locs, base = kv.write_pool, p.locs, layer * kv.write_rows
            else:
                pool = prefill_pages(kv, layer, p)  # [P * Hkv, 2, B, d], page i at pool rows i * Hkv + h
                locs, base = torch.arange(pool.shape[0] // kv.layout.num_kv_heads, device=pool.device), 0
            hkv = kv.layout.num_kv_heads
            o, _ = ops.paged_prefill(q, pool, locs, base, hkv, p.length, backend=self.backend)
            return o
        keys, values = prefill_kv(kv, layer, p)
        return prefill_attention(q, keys.to(q.dtype), values.to(q.dtype), window)

    def warm_up(self, num_heads: int, dtype: torch.dtype, max_length: int, chunk: int = 0) -> None:
        """Compile and plan the prefill's kernels now rather than in a user's request (num_heads
        query heads of `dtype`; outputs discarded):
        - the paged prefill's variants (one per query tile size; the split merge's, one per power of
          two of splits up to its chunk): a chunk of 1, 2, 4 ... PAGED_PREFILL_MAX_QUERIES queries
          over page 0 of the write pool repeated to 64, 128, 256 ... keys up to max_length (and
          max_length). With 8,192 keys only, a 32K prompt's tail compiled a merge variant inside
          the first request (0.79 s on a fresh H100, prefill_llama8b_32k_restart_h100.json);
        - where a `chunk` of prompt tokens goes to cuDNN (CUDNN_MIN_QUERIES or more): its plans for
          that chunk, causal, and for every key block of CUDNN_KEY_BLOCKS that a prompt of
          max_length tokens meets (one call over a prefix of each block once). The first plan
          of a kind cost 1.1-1.3 s on the H200 (prefill_attention_first_calls_h200.json); a
          fresh H100's first 128K prefill took 15.67 s, a minute later 12.60 s (6e3ad5e)."""
        if not self.fast:
            return
        self._warm_paged(num_heads, dtype, max_length)
        if chunk >= CUDNN_MIN_QUERIES:
            self._plan_cudnn(num_heads, dtype, max_length, chunk)

    def _plan_cudnn(self, num_heads: int, dtype: torch.dtype, max_length: int, chunk: int) -> None:
        lay, device = self.kv.layout, self.kv.write_pool.device
        chunk = min(chunk, max_length)
        blocks = [b for b in CUDNN_KEY_BLOCKS if b <= max_length - chunk]
        q = torch.zeros(chunk, num_heads, lay.head_dim, dtype=dtype, device=device)  # [n, Hq, d]
        keys = torch.zeros(sum(blocks) + chunk, lay.num_kv_heads, lay.head_dim, dtype=dtype, device=device)
        if fast_prefill_applies(q, keys):
            prefill_attention(q, keys, keys)  # the prefix cut into each block once, then the chunk

    def _warm_paged(self, num_heads: int, dtype: torch.dtype, max_length: int) -> None:
        lay, pool = self.kv.layout, self.kv.write_pool
        top = max(PAGED_PREFILL_MAX_QUERIES, max_length)
        keys = [PREFILL_BLOCK_N << k for k in range(top.bit_length())]  # splits 1, 2, 4 ... (short prompts)
        lengths = [k for k in keys if k < top] + [top]
        # page 0 again; int64 as every real call's locs (`_prefill`): the pointer's type is part
        # of the compiled variant, so int32 ones left one to compile in the first request (by the
        # code, what the 0.64 s of a 128K prompt's tail on a fresh H200 was, in
        # prefill_llama8b_128k_spill_behind_h200.json; not confirmed on a GPU)
        locs = torch.zeros(-(-top // lay.page_size), dtype=torch.int64, device=pool.device)
        n = 1
        while n <= PAGED_PREFILL_MAX_QUERIES:
            q = torch.zeros(n, num_heads, lay.head_dim, dtype=dtype, device=pool.device)  # [n, Hq, d]
            for length in lengths:
                if n <= length:
                    ops.paged_prefill(q, pool, locs, 0, lay.num_kv_heads, length, backend=self.backend)
            n *= 2


def prefill_pages(kv: KVManager, layer: int, p: PrefillMeta) -> torch.Tensor:
    """The sequence's pages of one layer in the pool's layout, [P * Hkv, 2, B, d] (page i, KV head
    h at row i * Hkv + h): the pages `p.settled_pids` from the tier (bypassing the cache; only those
    that left the prefill window), then the write-pool pages `p.locs`."""
    lay = kv.layout
    parts = []
    if p.settled_pids.numel():
        slots = page_slots(layer, lay.max_pages, p.settled_pids, kv.heads).flatten()
        parts.append(kv.settled.read(slots))
    # the write pool as [L, rows, Hkv, 2, B, d]: one gather of whole rows, no slot arithmetic (the
    # slots of page_slots, (layer * rows + loc) * Hkv + h, are this view's order)
    by_row = kv.write_pool.view(lay.num_layers, kv.write_rows, lay.num_kv_heads, *kv.write_pool.shape[1:])
    parts.append(by_row[layer].index_select(0, p.locs).flatten(0, 1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def prefill_kv(kv: KVManager, layer: int, p: PrefillMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `p.length` tokens' keys and values of one layer, [length, Hkv, d] each (contiguous:
    the flash kernel's layout), from prefill_pages."""
    lay = kv.layout
    pages = prefill_pages(kv, layer, p).view(-1, lay.num_kv_heads, 2, lay.page_size, lay.head_dim)
    kv_tokens = pages.permute(2, 0, 3, 1, 4).reshape(2, -1, lay.num_kv_heads, lay.head_dim)
    return kv_tokens[0, : p.length], kv_tokens[1, : p.length]
