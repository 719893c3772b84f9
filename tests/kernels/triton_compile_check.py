"""Compile the selection, hot-page cache, sparse attention, paged prefill and eigensolver kernels for
sm_90 with the specialisations the engine's launches produce.

Run by tests/kernels/test_triton_compile.py in a process without TRITON_INTERPRET (the
interpreter replaces the kernels by Python functions that cannot be compiled):
    python -m pytest tests/kernels/triton_compile_check.py
"""

from __future__ import annotations

import itertools

import pytest
import triton
import triton.language as tl
from lockserve.kernels.triton import select_kernel as sk
from lockserve.kernels.triton.attention_kernel import sparse_decode_kernel
from lockserve.kernels.triton.select import DEFAULT_RADIX_BITS as RADIX_BITS
from lockserve.kernels.triton.select import _warps
from lockserve.offload import triton_cache as tc
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(fn, signature: dict, constexprs: dict, divisible: list[int], num_warps: int,
                     num_stages: int | None = None):
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    return triton.compile(src, target=TARGET, options=options)


def signature(names: str, types: str) -> dict:
    return dict(zip(names.split(), types.split(), strict=True))


CHUNK = signature("s_ptr stats_ptr num_pages_ptr cand_key_ptr cand_pos_ptr P K NC SINK RECENT HKV G CH BITS",
                  "*fp32 *fp32 *i32 *fp32 *i32 i32 i32 i32 i32 i32 constexpr constexpr constexpr constexpr")
SELECT = signature(
    "cand_key_ptr cand_pos_ptr budgets_ptr num_pages_ptr tail_len_ptr tail_loc_ptr table_ptr slots_ptr "
    "lens_ptr open_ptr idx_ptr C K st_b layer_base write_front write_base HKV PAGE CB KB BITS",
    "*fp32 *i32 *i32 *i32 *i32 *i32 *i32 *i64 *i32 *i8 *i64 i32 i32 i32 i32 i32 i32 "
    "constexpr constexpr constexpr constexpr constexpr")


@pytest.mark.parametrize("ch,g", [(1024, 4), (2048, 16), (4096, 4)])
def test_chunk_topk_compiles(ch, g):
    for flags in itertools.product([False, True], repeat=3):  # P, K, NC divisible by 16 or not
        divisible = list(range(5)) + [i for i, f in zip((5, 6, 7), flags, strict=True) if f]
        compile_for_sm90(sk.chunk_topk_kernel, CHUNK, {"HKV": 8, "G": g, "CH": ch, "BITS": RADIX_BITS},
                         divisible, _warps(ch))


@pytest.mark.parametrize("bits", [2])  # RADIX_BITS's other setting (the tests above take the default)
def test_radix_settings_compile(bits):
    compile_for_sm90(sk.chunk_topk_kernel, CHUNK, {"HKV": 8, "G": 4, "CH": 4096, "BITS": bits},
                     list(range(8)), _warps(4096))
    compile_for_sm90(sk.select_slots_kernel, SELECT, {"HKV": 8, "PAGE": 16, "CB": 2048, "KB": 128,
                                                      "BITS": bits}, list(range(11)) + [12, 13], _warps(2048))


SHARD = signature("s_ptr stats_ptr first_ptr settled_ptr num_pages_ptr cand_key_ptr cand_pos_ptr P K NC SINK "
                  "RECENT HKV G CH BITS",
                  "*fp32 *fp32 *i64 *i64 *i64 *fp32 *i32 i32 i32 i32 i32 i32 constexpr "
                  "constexpr constexpr constexpr")


@pytest.mark.parametrize("ch,g", [(1024, 4), (2048, 16)])
def test_shard_topk_compiles(ch, g):
    for flags in itertools.product([False, True], repeat=3):  # P, K, NC divisible by 16 or not
        divisible = list(range(7)) + [i for i, f in zip((7, 8, 9), flags, strict=True) if f]
        compile_for_sm90(sk.shard_topk_kernel, SHARD, {"HKV": 8, "G": g, "CH": ch, "BITS": RADIX_BITS},
                         divisible, _warps(ch))


PICK = signature("gath_ptr cand_ptr take_ptr first_ptr count_ptr num_pages_ptr out_ptr R ROWS T EMPTY "
                 "NO_PAGE SINK RECENT HKV TB WB GC UC",
                 "*i64 *i64 *i64 *i64 *i64 *i64 *i64 i32 i32 i32 i64 i32 " + "constexpr " * 7)


@pytest.mark.parametrize("t,r", [(125, 2), (128, 1), (253, 3)])
def test_shard_select_compiles(t, r):
    from lockserve.kernels.triton.checks import next_pow2
    from lockserve.kernels.triton.select import SELECT_TILE

    tb, wb = next_pow2(t), next_pow2(t + 3)
    const = {"SINK": 1, "RECENT": 2, "HKV": 8, "TB": tb, "WB": wb,
             "GC": max(16, min(next_pow2(r * t), SELECT_TILE // tb)), "UC": max(16, SELECT_TILE // wb)}
    for flags in itertools.product([False, True], repeat=2):  # ROWS, T divisible by 16 or not
        divisible = list(range(7)) + [i for i, f in zip((8, 9), flags, strict=True) if f]
        compile_for_sm90(sk.shard_select_kernel, PICK, const, divisible, 4)


CANDIDATES = signature("key_ptr col_ptr first_ptr out_ptr C T EMPTY NO_PAGE HKV CB TB BITS",
                       "*fp32 *i32 *i64 *i64 i32 i32 i64 i32 constexpr constexpr constexpr constexpr")


@pytest.mark.parametrize("c,t", [(16 * 125, 125), (3 * 40, 40), (30, 64)])
def test_shard_candidates_compiles(c, t):
    from lockserve.kernels.triton.checks import next_pow2

    const = {"HKV": 8, "CB": next_pow2(c), "TB": next_pow2(t), "BITS": RADIX_BITS}
    for flags in itertools.product([False, True], repeat=2):  # C, T divisible by 16 or not
        divisible = list(range(4)) + [i for i, f in zip((4, 5), flags, strict=True) if f]
        compile_for_sm90(sk.shard_candidates_kernel, CANDIDATES, const, divisible, _warps(next_pow2(c)))


SHARD_SLOTS = signature(
    "sel_ptr first_ptr num_pages_ptr tail_len_ptr tail_loc_ptr table_ptr slots_ptr lens_ptr open_ptr idx_ptr "
    "K st_b layer_base write_front write_base HKV PAGE BLOCK",
    "*i64 *i64 *i64 *i64 *i64 *i32 *i64 *i32 *i8 *i64 i32 i32 i32 i32 i32 constexpr constexpr constexpr")


def test_shard_slots_compiles():
    for flags in itertools.product([False, True], repeat=2):  # K, st_b divisible by 16 or not
        divisible = list(range(10)) + [i for i, f in zip((10, 11), flags, strict=True) if f]
        const = {"HKV": 8, "PAGE": 16, "BLOCK": 128}
        compile_for_sm90(sk.shard_slots_kernel, SHARD_SLOTS, const, divisible, 4)


@pytest.mark.parametrize("cb,k", [(1024, 128), (4096, 256), (2048, 64)])
def test_select_slots_compiles(cb, k):
    # C (argument 11) is never specialised (do_not_specialize); everything else may be.
    for flags in itertools.product([False, True], repeat=2):  # K, st_b; the bases: 0 at layer 0
        divisible = list(range(11)) + [i for i, f in zip((12, 13), flags, strict=True) if f] + [14, 15, 16]
        const = {"HKV": 8, "PAGE": 16, "CB": cb, "KB": triton.next_power_of_2(k), "BITS": RADIX_BITS}
        compile_for_sm90(sk.select_slots_kernel, SELECT, const, divisible, _warps(cb))


LOOKUP_ARGS = ("slots_ptr ways_ptr counters_ptr call_ptr pos_ptr src_ptr pool_ptr idx_ptr entry_ptr "
               "kind_ptr tag_ptr outside_ptr rows_ptr done_ptr M NUM_SETS CAPACITY WAYS WAYS_P2 PAGE_WORDS "
               "BLOCK SCAN HAS_OUTSIDE FUSED INLINE COMMIT_BLOCK CHUNKS")
COMMIT = signature("slots_ptr entry_ptr kind_ptr ways_ptr counters_ptr call_ptr M BLOCK",
                   "*i64 *i64 *i8 *i64 *i64 *i64 i32 constexpr")


@pytest.mark.parametrize("ways,page_words,scan,outside,commit", [(16, 1024, 512, True, "fused"),
                                                                 (16, 2048, 64, False, "fused"),
                                                                 (3, 512, 16, True, "launch"),
                                                                 (16, 1024, 256, True, "launch"),
                                                                 (16, 1024, 512, True, "inline"),
                                                                 (3, 2048, 64, False, "inline"),
                                                                 (16, 4096, 512, True, "inline")])
def test_cache_lookup_compiles(ways, page_words, scan, outside, commit):
    # outside_ptr: the open-page mask (int8), or the slots again when there is none (never read).
    mask = "*i8" if outside else "*i64"
    types = f"{'*i64 ' * 5}*i32 *i32 *i64 *i64 *i8 *i64 {mask} *i64 *i32 i32 i32 i32 " + "constexpr " * 10
    const = {"WAYS": ways, "WAYS_P2": triton.next_power_of_2(ways), "PAGE_WORDS": page_words,
             "BLOCK": min(page_words, 2048), "SCAN": scan, "HAS_OUTSIDE": outside,
             "FUSED": commit == "fused", "INLINE": commit == "inline", "COMMIT_BLOCK": 1024,
             "CHUNKS": -(-page_words // 2048)}
    for flags in itertools.product([False, True], repeat=2):  # M, NUM_SETS divisible by 16 or not
        capacity = [16] if ways % 16 == 0 else []  # NUM_SETS * WAYS
        divisible = list(range(14)) + [i for i, f in zip((14, 15), flags, strict=True) if f] + capacity
        compile_for_sm90(tc.cache_lookup_kernel, signature(LOOKUP_ARGS, types), const, divisible, 4)


def test_cache_commit_compiles():
    for divisible in (list(range(6)), list(range(7))):
        compile_for_sm90(tc.cache_commit_kernel, COMMIT, {"BLOCK": 256}, divisible, 4)


ATTENTION_ARGS = ("q_ptr pool_ptr slots_ptr lens_ptr o_ptr lse_ptr K pages_per_split sm_scale "
                  "sq_b sq_h sq_d sp_s sp_kv sp_t sp_d ssl_b ssl_h ssl_k sln_b sln_h sln_k "
                  "so_s so_b so_h so_d sl_s sl_b sl_h HKV G GP D DP B BB PAGES DOT UPCAST IEEE")


@pytest.mark.parametrize("o_dtype", ["*fp32", "*bf16"])
@pytest.mark.parametrize("hkv,g,d", [(3, 3, 64), (8, 4, 128), (2, 16, 128)])
def test_sparse_decode_compiles_with_int32_views_of_int64_slots(o_dtype, hkv, g, d):
    """The engine's slots are int64 [Bt, Hkv, K], read as an int32 view (kernels/triton/attention.py
    int32_ids): strides doubled, the last one 2. Unit strides are specialised to 1 (constexpr)."""
    types = (f"*bf16 *bf16 *i32 *i32 {o_dtype} *fp32 i32 i32 fp32 " + "i32 i32 constexpr " +
             "i32 i32 i32 constexpr " + "i32 i32 i32 " + "i32 i32 constexpr " + "i32 i32 i32 constexpr " +
             "i32 i32 constexpr " + "constexpr " * 11).split()
    const = {"sq_d": 1, "sp_d": 1, "sln_k": 1, "so_d": 1, "sl_h": 1, "HKV": hkv, "G": g,
             "GP": max(16, triton.next_power_of_2(g)), "D": d, "DP": max(16, triton.next_power_of_2(d)),
             "B": 16, "BB": 16, "PAGES": 4, "DOT": tl.bfloat16, "UPCAST": False, "IEEE": False}
    names = ATTENTION_ARGS.split()
    sig = dict(zip(names, types, strict=True))
    ints = [i for i, n in enumerate(names) if sig[n] == "i32"]
    slot_k = names.index("ssl_k")  # 2: never divisible
    for flags in itertools.product([False, True], repeat=2):  # K and the slot strides: divisible or not
        divisible = list(range(6)) + [i for i in ints if i != slot_k and (flags[0] or names[i] != "K")
                                      and (flags[1] or not names[i].startswith("ssl"))]
        compile_for_sm90(sparse_decode_kernel, sig, const, divisible, 4, num_stages=3)  # AttentionTuning


PREFILL_ARGS = ("q_ptr pool_ptr locs_ptr o_ptr lse_ptr N L base keys_per_split sm_scale "
                "sq_t sq_h sq_d sp_s sp_kv sp_t sp_d s_loc so_s so_t so_h so_d sl_s sl_t sl_h "
                "HKV G D DP B BLOCK_M BLOCK_N DOT UPCAST IEEE")


@pytest.mark.parametrize("o_dtype", ["*fp32", "*bf16"])
@pytest.mark.parametrize("hkv,g,block_m", [(8, 4, 128), (4, 8, 128), (2, 16, 64)])
def test_paged_prefill_compiles(o_dtype, hkv, g, block_m):
    """The engine's launch (kernels/triton/prefill.py): bf16 q and write pool, int64 page locations,
    the partials float32 (or o itself, in q's dtype, with one split); unit strides constexpr; the
    layer's base an i32 or an i64 (past 2^31 slots), lengths divisible by 16 or not."""
    from lockserve.kernels.triton.prefill import BLOCK_N
    from lockserve.kernels.triton.prefill_kernel import paged_prefill_kernel

    names = PREFILL_ARGS.split()
    for base_type, divisible_lengths in itertools.product(["i32", "i64"], [False, True]):
        types = (f"*bf16 *bf16 *i64 {o_dtype} *fp32 i32 i32 {base_type} i32 fp32 " + "i32 i32 constexpr " +
                 "i32 i32 i32 constexpr constexpr " + "i32 i32 i32 constexpr " + "i32 i32 constexpr " +
                 "constexpr " * 10).split()
        sig = dict(zip(names, types, strict=True))
        const = {"sq_d": 1, "sp_d": 1, "s_loc": 1, "so_d": 1, "sl_h": 1, "HKV": hkv, "G": g, "D": 128,
                 "DP": 128, "B": 16, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "DOT": tl.bfloat16,
                 "UPCAST": False, "IEEE": False}
        lengths = {"N", "L", "base", "keys_per_split"}
        divisible = list(range(5)) + [i for i, n in enumerate(names) if sig[n] in ("i32", "i64")
                                      and (divisible_lengths or n not in lengths)]
        warps = 8 if block_m == 128 else 4  # the launcher's choice for d = 128
        compile_for_sm90(paged_prefill_kernel, sig, const, divisible, warps, num_stages=2)


@pytest.mark.parametrize("b", [16, 32])
def test_jacobi_eigh_compiles(b):
    """The summary build's eigensolver (float64 gathers over [MB, B, B] register tiles)."""
    from lockserve.kernels.triton.eigh import MATRICES_PER_PROGRAM, SWEEPS
    from lockserve.kernels.triton.eigh_kernel import jacobi_eigh_kernel

    sig = signature("a_ptr w_ptr v_ptr N SWEEPS B MB", "*fp64 *fp64 *fp64 i32 constexpr constexpr constexpr")
    for divisible in ([0, 1, 2], [0, 1, 2, 3]):
        compile_for_sm90(jacobi_eigh_kernel, sig, {"SWEEPS": SWEEPS, "B": b, "MB": MATRICES_PER_PROGRAM},
                         divisible, num_warps=4)
