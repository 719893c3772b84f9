"""PagedAttention + KVManager against a brute-force reference, on every tier and both modes.

A scripted sequence of steps (chunked prefills mixed with decodes, three sequences of different
lengths, page size 4 so contexts span many pages) drives the attention with random q/k/v. The
reference keeps each sequence's K/V in plain tensors and recomputes everything per query:
causal softmax attention for prefill; for LOCKS decode it builds and quantises the summaries of
the full pages itself, scores, selects, and attends over the selected tokens only.
"""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.kernels import (
    LocksConfig,
    build_summaries,
    dequantize_summaries,
    group_scores,
    quantize_summaries,
    score_pages_ref,
    select_pages,
)
from lockserve.workers.engine import attention
from lockserve.workers.engine.attention import PagedAttention, plan_step, prefill_attention
from lockserve.workers.engine.decode_state import DecodeState
from lockserve.workers.engine.kv_manager import KVLayout, KVManager, TierSpec, page_slots
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.engine.scheduler import Batch, Chunk, PageIdAllocator
from lockserve.workers.engine.sequence import Sequence
from lockserve.workers.model.layers import QKV

from tests.conftest import assert_close, triton_devices

L, HQ, HKV, D, B = 2, 4, 2, 16, 4
K_PAGES = 4  # LOCKS budget: 16 tokens, so contexts beyond 4 pages are scored and pruned
LOCKS = LocksConfig(page_size=B, rank=2, basis_bits=4)
LENGTHS = {"a": 61, "b": 43, "c": 9}
# Each step: (sequence, first position, tokens, is_decode). Decodes must continue a finished prompt.
SCRIPT = [
    [("a", 0, 13, False), ("b", 0, 7, False)],
    [("a", 13, 27, False), ("b", 7, 5, False), ("c", 0, 3, False)],
    [("a", 40, 1, True), ("b", 12, 21, False), ("c", 3, 5, False)],
    *[[("a", 41 + i, 1, True), ("b", 33 + i, 1, True), ("c", 8, 1, True)] if i == 0 else
      [("a", 41 + i, 1, True), ("b", 33 + i, 1, True)] for i in range(10)],
    *[[("a", 51 + i, 1, True)] for i in range(10)],
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = {}
    for name, n in LENGTHS.items():
        q = torch.randn(L, n, HQ, D, generator=g)
        k = torch.randn(L, n, HKV, D, generator=g)
        # Pages with distinct directions, so LOCKS selection depends on the query.
        k = k + 2 * torch.randn(L, math.ceil(n / B), HKV, D, generator=g).repeat_interleave(B, 1)[:, :n]
        data[name] = (q, k, torch.randn(L, n, HKV, D, generator=g))
    return data


def make_seqs(allocator, budget):
    seqs = {}
    for name, n in LENGTHS.items():
        seq = Sequence(name, list(range(n)), SamplingParams(max_tokens=1), None, None, frozenset(), budget)
        seq.pids = allocator.allocate(math.ceil(n / B) + 1)
        seqs[name] = seq
    return seqs


def run_script(kind, mode, tmp_path, host_pages=None, kernels="auto", device="cpu", script=SCRIPT,
               window_pages=0, windows=(None,) * L):
    """window_pages: the host tiers' prefill window (0: prefill chunks read settled pages from the tier).
    windows: each layer's sliding window (QKV.window), None: every key."""
    layout = KVLayout(L, HKV, D, B, torch.float32, max_pages=48)
    spec = TierSpec(kind, cache_pages=None if kind == "hbm" else 96, max_selected=3 * HKV * K_PAGES,
                    host_pages=host_pages, nvme_dir=str(tmp_path / "nvme"))
    kv = KVManager(layout, LOCKS, spec, torch.device(device), num_tail_pages=32, window_pages=window_pages)
    attn = PagedAttention(kv, sink_pages=1, recent_pages=2, kernels=kernels)
    state = DecodeState(4, layout.max_pages, B, torch.device(device))
    seqs = make_seqs(PageIdAllocator(layout.max_pages), None if mode == "dense" else K_PAGES)
    data, outputs = make_data(), []
    for step in script:
        chunks = [(Chunk(seqs[s], start, n), decode) for s, start, n, decode in step]
        decodes = [c for c, d in chunks if d]
        for seq in list(state.seqs):  # a sequence that stops decoding gives its row back
            if seq not in [c.seq for c in decodes]:
                state.remove(seq.request_id)
        batch = Batch(state.order(decodes), [c for c, d in chunks if not d])
        nd = len(batch.decodes)
        planned = [kv.plan(c, window=i >= nd) for i, c in enumerate(batch.chunks)]
        state.stage(batch.decodes, [locs[-1] for locs in planned[:nd]])
        prefixes = [kv.prefix(c) for c in batch.prefills]
        attn.bind(plan_step(batch, planned, B, state, mode == "locks", torch.device(device), prefixes))
        rows = [(c.seq.request_id, c.start, c.end, c in batch.decodes) for c in batch.chunks]

        def forward(batch=batch, rows=rows):  # one step's layers; host+nvme may run it again
            out = []
            for layer in range(L):
                q, k, v = (torch.cat([data[c.seq.request_id][i][layer, c.start : c.end]
                                      for c in batch.chunks])
                           .to(device) for i in range(3))
                out.append((layer, rows, attn(layer, identity_rope(q, k, v, windows[layer]))))
            return out

        outputs.extend(kv.run_forward(forward))
        kv.commit(list(zip(batch.chunks, planned, strict=True)))
        for c in batch.chunks:
            c.seq.num_computed = c.end
    return kv, seqs, outputs


def identity_rope(q, k, v, window=None) -> QKV:
    """The layer input of post-RoPE q, k, v: a fused projection with cos = 1, sin = 0 (exact)."""
    t = q.shape[0]
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    half = torch.zeros(t, D // 2, device=q.device)
    return QKV(qkv, half + 1, half, HQ, HKV, D, window)


def reference_prefill(q, keys, values, start, window=None):
    # q: [n, Hq, d] at positions start..; keys, values: [end, Hkv, d] -> [n, Hq, d]; a query at p
    # sees keys (p - window, p]
    kk = keys.repeat_interleave(HQ // HKV, dim=1)
    vv = values.repeat_interleave(HQ // HKV, dim=1)
    logits = torch.einsum("nhd,thd->hnt", q, kk) / math.sqrt(D)
    pos = torch.arange(start, start + q.shape[0])[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    hidden = (key_pos > pos) | (key_pos <= pos - (window or keys.shape[0] + 1))
    logits = logits.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(logits, dim=-1), vv)


def reference_selection(q, keys, n):
    """LOCKS pages selected for a query at position n - 1. q: [Hq, d]; keys: [n, Hkv, d] -> [Hkv, k]."""
    num_pages, settled = math.ceil(n / B), math.ceil(n / B) - 1
    full = keys[: settled * B].reshape(settled, B, HKV, D).permute(0, 2, 1, 3)  # [P, Hkv, B, d]
    s = dequantize_summaries(quantize_summaries(build_summaries(full, LOCKS.rank), LOCKS))
    s_hat = score_pages_ref(q[None], s, torch.arange(settled)[None], torch.tensor([settled]))
    m_bar = torch.cat([group_scores(s_hat), torch.zeros(1, HKV, 1)], dim=-1)  # the open page: unscored
    return select_pages(m_bar, torch.tensor([num_pages]), K_PAGES, 1, 2)[0]


def reference_decode(q, keys, values, n, locks):
    # q: [Hq, d]; keys, values: [n, Hkv, d] -> [Hq, d]
    num_pages = math.ceil(n / B)
    if locks and num_pages > K_PAGES:
        sel = reference_selection(q, keys, n)
    else:
        sel = torch.arange(num_pages).expand(HKV, -1)
    out = torch.empty(HQ, D)
    for h in range(HQ):
        kvh = h // (HQ // HKV)
        tokens = torch.cat([torch.arange(p * B, min(p * B + B, n)) for p in sel[kvh].tolist() if p >= 0])
        w = torch.softmax(keys[tokens, kvh] @ q[h] / math.sqrt(D), dim=0)
        out[h] = w @ values[tokens, kvh]
    return out


@pytest.mark.parametrize("mode", ["dense", "locks"])
def test_attention_matches_reference(mode, tmp_path):
    kv, _, outputs = run_script("hbm", mode, tmp_path)
    data = make_data()
    for layer, rows, o in outputs:
        offset = 0
        for name, start, end, decode in rows:
            q, k, v = (t[layer] for t in data[name])
            got = o[offset : offset + end - start]
            if decode:
                want = reference_decode(q[start], k[:end], v[:end], end, mode == "locks")[None]
            else:
                want = reference_prefill(q[start:end], k[:end], v[:end], start)
            assert_close(got, want, f"{mode}: layer {layer}, sequence {name}, tokens {start}..{end}")
            offset += end - start
    kv.close()


# Layer 0 slides (7 tokens: a window that starts inside a page of 4 at most steps), layer 1 is global.
WINDOWS = (7, None)


@pytest.mark.parametrize(("mode", "kind"), [("dense", "hbm"), ("locks", "hbm"), ("locks", "host")])
def test_sliding_window_layers_attend_exactly_their_window(mode, kind, tmp_path):
    """A window layer's prefill chunks and decodes see exactly keys (p - 7, p], never a LOCKS
    selection (the reference's window layer is plain windowed softmax); the global layer is
    unchanged (LOCKS-pruned in locks mode)."""
    kv, _, outputs = run_script(kind, mode, tmp_path, windows=WINDOWS)
    data = make_data()
    for layer, rows, o in outputs:
        offset, window = 0, WINDOWS[layer]
        for name, start, end, decode in rows:
            q, k, v = (t[layer] for t in data[name])
            got = o[offset : offset + end - start]
            if decode and window is None:
                want = reference_decode(q[start], k[:end], v[:end], end, mode == "locks")[None]
            else:
                want = reference_prefill(q[start:end], k[:end], v[:end], start, window)
            assert_close(got, want, f"{mode}:{kind}: layer {layer} (window {window}), sequence {name}, "
                                    f"tokens {start}..{end}")
            offset += end - start
    kv.close()


def test_window_decode_reads_only_the_window(tmp_path):
    """Every decode of the window layer reads the pages overlapping its last 7 keys (2 or 3 pages of
    4) and attends exactly 7 tokens, whatever the context; the global layer reads more."""
    traces = []
    real = PagedAttention.__init__

    def observed(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.observer = lambda t: traces.append((t.layer, t.tokens_attended().clone(),
                                                 (t.selection.lens > 0).sum(dim=-1).clone()))

    PagedAttention.__init__ = observed
    try:
        kv, _, _ = run_script("hbm", "dense", tmp_path, windows=WINDOWS)
    finally:
        PagedAttention.__init__ = real
    kv.close()
    window_traces = [t for t in traces if t[0] == 0]
    assert window_traces and len(window_traces) == len(traces) // 2
    for _, tokens, pages in window_traces:
        assert bool((tokens == 7).all()), f"window layer attended {tokens.tolist()} tokens, not 7"
        assert bool(((pages >= 2) & (pages <= 3)).all()), pages.tolist()
    assert max(int(t[1].max()) for t in traces if t[0] == 1) == 61  # the global layer: every key


def test_locks_prunes_pages():
    """The budget is binding in the script: the reference selection drops pages for long contexts."""
    q, k, _ = (t[0] for t in make_data()["a"])
    sel = reference_selection(q[60], k[:61], 61)
    assert sel.shape == (HKV, K_PAGES) and bool((sel >= 0).all())
    assert math.ceil(61 / B) > K_PAGES


@pytest.mark.parametrize("window_pages", [0, 3, 64])
@pytest.mark.parametrize("kind,host_pages", [("host", None), ("host+nvme", 40)])
def test_offloaded_tiers_equal_hbm_exactly(kind, host_pages, window_pages, tmp_path):
    """Where the pages live never changes the math: outputs, settled pages and summaries are equal,
    with prefill windows that hold none, some (3 pages: the oldest leave) or all of the prefixes."""
    ref_kv, ref_seqs, ref_out = run_script("hbm", "locks", tmp_path / "hbm")
    kv, seqs, out = run_script(kind, "locks", tmp_path / "off", host_pages=host_pages,
                               window_pages=window_pages)
    for (layer, rows, want), (_, _, got) in zip(ref_out, out, strict=True):
        assert torch.equal(got, want), f"{kind}: layer {layer}, rows {rows}"
    heads = torch.arange(HKV)
    for name, seq in seqs.items():
        settled = seq.num_computed // B
        for layer in range(L):
            got = kv.settled.read(page_slots(layer, 48, torch.tensor(seq.pids[:settled]), heads).flatten())
            want = ref_kv.settled.read(
                page_slots(layer, 48, torch.tensor(ref_seqs[name].pids[:settled]), heads).flatten())
            assert torch.equal(got, want), f"{kind}: settled pages of {name}, layer {layer}"
    assert torch.equal(kv.summaries.table.coef_q, ref_kv.summaries.table.coef_q)
    if kind == "host+nvme":
        assert kv.settled.store.describe()["spilled_pages"] > 0, "the host arena was meant to overflow"
    stats = kv.stats()
    assert stats.hits > 0 and stats.misses > 0
    kv.close()
    ref_kv.close()


def prefill_tier_reads(window_pages, tmp_path):
    """Pages the prefill chunks of SCRIPT read from the host tier (not through the decode cache)."""
    reads = []
    real = KVManager.__init__

    def counting(self, *args, **kwargs):
        real(self, *args, **kwargs)
        read = self.settled.read
        self.settled.read = lambda slots: reads.append(slots.numel()) or read(slots)

    KVManager.__init__ = counting
    try:
        kv, _, _ = run_script("host", "locks", tmp_path, window_pages=window_pages)
    finally:
        KVManager.__init__ = real
    kv.close()
    return sum(reads)


def test_prefill_window_keeps_the_prefix_off_pcie(tmp_path):
    """With a window holding every prefix, no prefill chunk reads a page back from the host; with
    none, chunks after the first read their settled prefix (the decodes read no tier pages
    through `read`: they go through the cache)."""
    assert prefill_tier_reads(64, tmp_path / "all") == 0
    none = prefill_tier_reads(0, tmp_path / "none")
    # step 2: a's 13 tokens settled 3 pages, b's 7 one; step 3: b's 12 tokens settled 3 (x L x Hkv)
    assert none == (3 + 1 + 3) * L * HKV, none
    some = prefill_tier_reads(2, tmp_path / "some")
    assert 0 < some < none, (some, none)


@pytest.mark.parametrize("window_pages", [0, 5])
def test_windows_close_when_prefills_end(window_pages, tmp_path):
    """Every window is given back when its prefill ends: only the open pages stay in the pool."""
    kv, seqs, _ = run_script("host", "locks", tmp_path, window_pages=window_pages)
    assert not kv._windows
    assert kv.num_free_tail_pages == 32 + window_pages - 3
    kv.close()


def test_release_returns_tail_pages(tmp_path):
    kv, seqs, _ = run_script("host", "locks", tmp_path)
    assert kv.num_free_tail_pages == 32 - 3  # each sequence holds its open page
    for name, seq in seqs.items():
        kv.release(name, seq.pids, seq.num_computed // B)
    assert kv.num_free_tail_pages == 32
    kv.close()


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("windows", [(None, None), WINDOWS])
def test_triton_kernels_agree_with_the_reference_path(device, windows, tmp_path):
    """The engine's ops path (Triton score + sparse decode; on a window layer the kernel merged
    with the reference's masked first page) against its reference path; on CPU (Triton's
    interpreter) only the first steps, three of them with scored LOCKS decodes."""
    kind, script = ("host", SCRIPT[:5]) if device == "cpu" else ("hbm", SCRIPT)
    _, _, want = run_script(kind, "locks", tmp_path / "ref", kernels="reference", device=device,
                            script=script, windows=windows)
    kv, _, got = run_script(kind, "locks", tmp_path / "ops", kernels="ops", device=device, script=script,
                            windows=windows)
    for (layer, rows, o_ref), (_, _, o_ops) in zip(want, got, strict=True):
        assert_close(o_ops, o_ref, f"layer {layer}, rows {rows}")
    kv.close()


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("kind,window_pages", [("hbm", 0), ("host", 16), ("host", 0)])
def test_prefill_chunks_attend_pages_where_they_lie(device, kind, window_pages, tmp_path, monkeypatch):
    """The ops path's prefill chunks (all short) run the paged kernel: over the write pool where
    every page of the prefix is there (hbm; a host tier's window holding the prefix), over the
    gathered pages otherwise (a host tier without a window: the settled pages come from the tier);
    either way the reference path's outputs. The prefill steps of the script (on CPU, Triton's
    interpreter)."""
    from lockserve.kernels import ops

    calls, paged = [], ops.paged_prefill

    def counted(*args, **kwargs):
        calls.append((*args[4:6], args[1].data_ptr()))  # (KV heads, length, the pool's address)
        return paged(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_prefill", counted)
    script = SCRIPT[:3]
    _, _, want = run_script(kind, "locks", tmp_path / "ref", kernels="reference", device=device,
                            script=script, window_pages=window_pages)
    assert not calls, "the reference path gathers"
    kv, _, got = run_script(kind, "locks", tmp_path / "ops", kernels="ops", device=device, script=script,
                            window_pages=window_pages)
    for (layer, rows, o_ref), (_, _, o_ops) in zip(want, got, strict=True):
        assert_close(o_ops, o_ref, f"layer {layer}, rows {rows}")
    chunks = sum(1 for step in script for *_, decode in step if not decode)
    lengths = [(hkv, length) for hkv, length, _ in calls]
    assert len(calls) == chunks * L and (HKV, 61) not in lengths and (HKV, 40) in lengths, lengths
    in_pool = sum(1 for *_, pool in calls if pool == kv.write_pool.data_ptr())
    if kind == "host" and not window_pages:
        # a chunk reads the tier for settled pages: only the first chunks (no settled page yet) read the pool
        assert 0 < in_pool < chunks * L, calls
    else:
        assert in_pool == chunks * L, calls
    kv.close()


@pytest.mark.parametrize("n,length,hq,hkv", [(1, 1, 4, 4), (1, 37, 4, 1), (5, 5, 8, 2), (7, 61, 6, 3),
                                             (64, 200, 4, 2), (3, 50, 12, 4), (9, 300, 16, 1)])
@pytest.mark.parametrize("path", ["cpu-flash", "lower-right-bias"])
def test_prefill_attention_matches_brute_force(n, length, hq, hkv, path, monkeypatch):
    """Both kernel paths: CPU flash (split + merge) and the one-call lower-right bias (CUDA's)."""
    if path == "lower-right-bias":
        monkeypatch.setattr(attention, "_cpu_flash", None)
    else:
        assert attention._cpu_flash is not None, "this torch lacks the CPU flash op"
    g = torch.Generator().manual_seed(n * length)
    q, k, v = (torch.randn(s, h, 16, generator=g) for s, h in ((n, hq), (length, hkv), (length, hkv)))
    want = torch.empty(n, hq, 16)
    for i in range(n):
        pos = length - n + i
        for h in range(hq):
            kv_head = h // (hq // hkv)
            w = torch.softmax(k[: pos + 1, kv_head] @ q[i, h] / 4.0, dim=0)
            want[i, h] = w @ v[: pos + 1, kv_head]
    assert_close(prefill_attention(q, k, v), want, f"n={n}, L={length}, Hq={hq}, Hkv={hkv}")


@pytest.mark.parametrize("n,length,window", [(1, 1, 4), (1, 37, 5), (5, 5, 2), (7, 61, 16), (64, 200, 17),
                                             (64, 200, 300), (30, 30, 1)])
def test_windowed_prefill_attention_matches_brute_force(n, length, window):
    """prefill_attention with a sliding window: query p sees keys (p - W, p] (transformers' mask)."""
    g = torch.Generator().manual_seed(n + length + window)
    q, k, v = (torch.randn(s, h, 16, generator=g) for s, h in ((n, 6), (length, 2), (length, 2)))
    want = brute_force_prefill(q, k, v, window)
    assert_close(prefill_attention(q, k, v, window), want, f"n={n}, L={length}, W={window}")


def brute_force_prefill(q, k, v, window=None):
    # q: [n, Hq, d]; k, v: [L, Hkv, d] -> [n, Hq, d] float32: query i at position L - n + i
    n, hq, d = q.shape
    length, hkv = k.shape[:2]
    kk, vv = (t.float().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    logits = torch.einsum("nhd,thd->hnt", q.float(), kk) / math.sqrt(d)
    pos = torch.arange(length - n, length, device=q.device)[:, None]
    key_pos = torch.arange(length, device=q.device)[None, :]
    hidden = (key_pos > pos) | (key_pos <= pos - (window or length + 1))
    logits = logits.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(logits, dim=-1), vv)


@pytest.mark.gpu
@pytest.mark.parametrize("n,length,window", [(1, 1037, 64), (7, 61, 16), (333, 4111, 1024),
                                             (2048, 2048, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_windowed_prefill_matches_brute_force(n, length, window, dtype):
    """FlashAttention-2 with window_size_left = W - 1 (GQA native) against the brute force."""
    g = torch.Generator(device="cuda").manual_seed(n + length)
    q, k, v = (torch.randn(s, h, 128, generator=g, device="cuda", dtype=dtype)
               for s, h in ((n, 16), (length, 4), (length, 4)))
    assert_close(prefill_attention(q, k, v, window), brute_force_prefill(q, k, v, window),
                 f"n={n}, L={length}, W={window}, {dtype}", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("n,length,hq,hkv,d", [(1, 1, 4, 4, 64), (1, 1037, 8, 1, 128), (5, 5, 16, 1, 128),
                                                (7, 61, 6, 3, 64), (333, 4111, 32, 8, 128),
                                                (2048, 2048, 32, 2, 128), (100, 9000, 16, 16, 128),
                                                (1024, 1024 + 24676, 8, 2, 128),  # 16K + 8K blocks + FA2 rest
                                                (1024, 1024 + 122880, 8, 1, 128)])  # every block size
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_cuda_fused_prefill_matches_brute_force(n, length, hq, hkv, d, dtype, kernel, monkeypatch):
    """The CUDA paths: cuDNN split and merged by LSE, or one flash call bottom-right causal (chunk
    over its prefix), GQA native: against the brute force at ragged lengths and G = 1..16."""
    if kernel == "flash":
        monkeypatch.setattr(attention, "_cuda_cudnn", None)
    else:
        assert attention._cuda_cudnn is not None, "this torch lacks the cuDNN attention op"
    g = torch.Generator(device="cuda").manual_seed(n + length)
    q, k, v = (torch.randn(s, h, d, generator=g, device="cuda", dtype=dtype)
               for s, h in ((n, hq), (length, hkv), (length, hkv)))
    assert attention.fast_prefill_applies(q, k), "the fused CUDA path does not apply"
    assert_close(prefill_attention(q, k, v), brute_force_prefill(q, k, v),
                 f"n={n}, L={length}, Hq={hq}, Hkv={hkv}, {dtype}", dtype=dtype)


@pytest.mark.parametrize("hkv,max_pages", [(3, 1001), (2, 77), (8, 5)])
def test_every_layers_summary_tables_are_16_byte_aligned(hkv, max_pages):
    """The CUDA score kernel needs 16-byte aligned tables: every layer's view of every field."""
    layout = KVLayout(5, hkv, 64, B, torch.float32, max_pages=max_pages)
    table = KVManager(layout, LOCKS, TierSpec("hbm"), torch.device("cpu"), num_tail_pages=4).summaries
    for layer, qs in enumerate(table.layers):
        for name in ("basis_q", "basis_scale", "coef_q", "coef_scale", "mu_q", "mu_scale"):
            t = getattr(qs, name)
            assert t.data_ptr() % 16 == 0 and t.shape[0] >= max_pages, (layer, name, t.data_ptr() % 16)


@pytest.mark.parametrize("device", triton_devices())
def test_warm_up_runs_every_paged_prefill_tile_and_leaves_the_pool(device, tmp_path, monkeypatch):
    """PagedAttention.warm_up launches the paged prefill for every chunk size 1, 2, 4 ... the
    largest it takes (each query tile size compiles then, not in a request) and, for each, over
    key lengths that meet every variant of the split merge that a prompt of up to max_length
    tokens can meet; it writes nothing into the pool; the reference path launches nothing."""
    from lockserve.kernels import ops
    from lockserve.kernels.triton.attention import MERGE_CHUNK
    from lockserve.kernels.triton.checks import next_pow2
    from lockserve.kernels.triton.prefill import _splits
    from lockserve.workers.engine.attention import PAGED_PREFILL_MAX_QUERIES

    calls, paged = [], ops.paged_prefill

    def counted(q, pool, locs, base, hkv, length, **kwargs):
        calls.append((q.shape[0], length))
        return paged(q, pool, locs, base, hkv, length, **kwargs)

    def merge_variant(length: int) -> int:  # the merge kernel's constexpr SC, 0 for no merge
        splits, _ = _splits(kv.layout.num_kv_heads, length, torch.device(device), None)
        return 0 if splits == 1 else min(MERGE_CHUNK, next_pow2(splits))

    monkeypatch.setattr(ops, "paged_prefill", counted)
    kv, _, _ = run_script("hbm", "locks", tmp_path, kernels="ops", device=device, script=SCRIPT[:1])
    calls.clear()
    pool = kv.write_pool.clone()
    # On a GPU a prompt of 300 tokens meets merges of 2, 4 and 8 splits. On the CPU _splits asks for
    # at most cdiv(4 programs, HKV 2) = 2 splits, so 128 keys meet every variant that 300 would; each
    # launch past 64 keys (a merge) costs 0.1-5 s in Triton's interpreter (300: 47 s, 128: 18 s).
    max_length = 300 if device == "cuda" else PAGED_PREFILL_MAX_QUERIES
    for kernels in ("reference", "ops"):
        PagedAttention(kv, kernels=kernels).warm_up(HQ, torch.float32, max_length)
    sizes = sorted({n for n, _ in calls})
    assert sizes == [2**i for i in range(PAGED_PREFILL_MAX_QUERIES.bit_length())], sizes
    warmed = {merge_variant(length) for _, length in calls}
    assert {merge_variant(length) for length in range(1, max_length + 1)} <= warmed, warmed
    assert all(n <= length <= max_length for n, length in calls), calls
    assert torch.equal(kv.write_pool, pool)
    kv.close()


def launch_signature(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a variant of `kernel` for, from a launch's arguments (its rules as of
    Triton 3.6, written out): each tensor's dtype and 16-byte alignment; each int's width, and
    unless do_not_specialize names it whether it is 1 or a multiple of 16; the constexprs and launch
    options. Two launches of one signature share a compiled kernel."""
    # the interpreter keeps the decorator's arguments in kwargs, a compiled JITFunction as an attribute
    names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", ())
    keep = {kernel.arg_names[n] if isinstance(n, int) else n for n in names or ()}
    sig = []
    for name, a in zip(kernel.arg_names, args, strict=False):
        if isinstance(a, torch.Tensor):
            sig.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            sig.append((name, type(a).__name__))
        else:
            width = "i32" if -(2**31) <= a < 2**31 else "i64"
            sig.append((name, width, "any" if name in keep else 1 if a == 1 else a % 16 == 0))
    return (*sig, *sorted((k, str(v)) for k, v in kwargs.items()))


@pytest.mark.parametrize("device", triton_devices())
def test_warm_up_compiles_every_paged_prefill_variant_a_prompt_launches(device, tmp_path, monkeypatch):
    """Every launch of the paged prefill (and its merge, where one runs) in real prefill chunks (a
    script of sequences on tier host: chunks over the write pool, and chunks reading settled pages
    back) has the Triton signature of a warm-up launch: nothing compiles in a user's request. The
    warm-up launched int32 page locations and the chunks int64 ones (by the code, the 0.64 s a
    fresh H200's first 128K prompt paid in its 48-token tail); chunks of 13 and 16 queries also
    differed in the lse's strides' class."""
    from lockserve.kernels.triton import attention_kernel, prefill_kernel

    seen: list[tuple] = []
    for kernel in (prefill_kernel.paged_prefill_kernel, attention_kernel.merge_splits_kernel):
        def recording(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kwargs):
            seen.append((_kernel.arg_names[0], launch_signature(_kernel, args, kwargs)))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", recording, raising=False)
    kv, _, _ = run_script("host", "locks", tmp_path, kernels="ops", device=device, script=SCRIPT[:3],
                          host_pages=40)
    real = set(seen)
    assert any(name == "q_ptr" for name, _ in real), "the script launches the paged prefill"
    seen.clear()
    PagedAttention(kv, kernels="ops").warm_up(HQ, torch.float32, 64)  # the script's sequences: <= 41 tokens
    missing = real - set(seen)
    assert not missing, f"compiled in a request, not in the warm-up: {sorted(missing)[:2]}"
    kv.close()


@pytest.mark.gpu
def test_warm_up_plans_cudnn_for_a_chunk_over_every_key_block(tmp_path, monkeypatch):
    """With a chunk that cuDNN takes, warm_up calls it for the chunk (causal) and for each key
    block a prompt of max_length meets (unmasked), so no first plan falls in a request."""
    if attention._cuda_cudnn is None:
        pytest.skip("this torch build has no cuDNN attention op")  # then FA2, which plans nothing
    parts, real = set(), attention._cudnn_part

    def counted(qh, kh, vh, causal):
        parts.add((qh.shape[2], kh.shape[2], causal))
        return real(qh, kh, vh, causal)

    monkeypatch.setattr(attention, "_cudnn_part", counted)
    kv, _, _ = run_script("hbm", "locks", tmp_path, kernels="ops", device="cuda", script=SCRIPT[:1])
    PagedAttention(kv, kernels="ops").warm_up(HQ, torch.bfloat16, 40000, 2048)
    assert {p for p in parts if p[1] > 1} == {(2048, 2048, True), (2048, 8192, False), (2048, 16384, False),
                                              (2048, 32768, False)}, parts
    kv.close()
