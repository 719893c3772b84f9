"""Compile the selection and hot-page cache kernels for sm_90 with the specialisations the engine's
launches produce.

Run by tests/kernels/test_triton_compile.py in a process without TRITON_INTERPRET (the
interpreter replaces the kernels by Python functions that cannot be compiled):
    python -m pytest tests/kernels/triton_compile_check.py
"""

from __future__ import annotations

import itertools

import pytest
import triton
from lockserve.kernels.triton import select_kernel as sk
from lockserve.kernels.triton.select import _warps
from lockserve.offload import triton_cache as tc
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(fn, signature: dict, constexprs: dict, divisible: list[int], num_warps: int):
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def signature(names: str, types: str) -> dict:
    return dict(zip(names.split(), types.split(), strict=True))


CHUNK = signature("s_ptr stats_ptr num_pages_ptr cand_key_ptr cand_pos_ptr P K NC SINK RECENT HKV G CH",
                  "*fp32 *fp32 *i32 *fp32 *i32 i32 i32 i32 i32 i32 constexpr constexpr constexpr")
SELECT = signature(
    "cand_key_ptr cand_pos_ptr budgets_ptr num_pages_ptr tail_len_ptr tail_loc_ptr table_ptr slots_ptr "
    "lens_ptr open_ptr idx_ptr C K st_b layer_base write_front write_base HKV PAGE CB KB",
    "*fp32 *i32 *i32 *i32 *i32 *i32 *i32 *i64 *i32 *i8 *i64 i32 i32 i32 i32 i32 i32 "
    "constexpr constexpr constexpr constexpr")


@pytest.mark.parametrize("ch,g", [(1024, 4), (2048, 16), (4096, 4)])
def test_chunk_topk_compiles(ch, g):
    for flags in itertools.product([False, True], repeat=3):  # P, K, NC divisible by 16 or not
        divisible = list(range(5)) + [i for i, f in zip((5, 6, 7), flags, strict=True) if f]
        compile_for_sm90(sk.chunk_topk_kernel, CHUNK, {"HKV": 8, "G": g, "CH": ch}, divisible, _warps(ch))


@pytest.mark.parametrize("cb,k", [(1024, 128), (4096, 256), (2048, 64)])
def test_select_slots_compiles(cb, k):
    # C (argument 11) is never specialised (do_not_specialize); everything else may be.
    for flags in itertools.product([False, True], repeat=2):  # K, st_b; the bases: 0 at layer 0
        divisible = list(range(11)) + [i for i, f in zip((12, 13), flags, strict=True) if f] + [14, 15, 16]
        const = {"HKV": 8, "PAGE": 16, "CB": cb, "KB": triton.next_power_of_2(k)}
        compile_for_sm90(sk.select_slots_kernel, SELECT, const, divisible, _warps(cb))


LOOKUP_ARGS = ("slots_ptr tags_ptr last_ptr counters_ptr call_ptr src_ptr pool_ptr idx_ptr entry_ptr "
               "kind_ptr outside_ptr rows_ptr M NUM_SETS CAPACITY WAYS WAYS_P2 PAGE_WORDS BLOCK SCAN "
               "HAS_OUTSIDE")
COMMIT = signature("slots_ptr entry_ptr kind_ptr tags_ptr last_ptr counters_ptr call_ptr M BLOCK",
                   "*i64 *i64 *i8 *i64 *i64 *i64 *i64 i32 constexpr")


@pytest.mark.parametrize("ways,page_words,scan,outside", [(16, 1024, 256, True), (16, 2048, 64, False),
                                                          (3, 512, 16, True)])
def test_cache_lookup_compiles(ways, page_words, scan, outside):
    # outside_ptr: the open-page mask (int8), or the slots again when there is none (never read).
    types = f"{'*i64 ' * 5}*i32 *i32 *i64 *i64 *i8 {'*i8' if outside else '*i64'} *i64 i32 i32 i32 " + \
        "constexpr " * 6
    const = {"WAYS": ways, "WAYS_P2": triton.next_power_of_2(ways), "PAGE_WORDS": page_words,
             "BLOCK": min(page_words, 2048), "SCAN": scan, "HAS_OUTSIDE": outside}
    for flags in itertools.product([False, True], repeat=2):  # M, NUM_SETS divisible by 16 or not
        capacity = [14] if ways % 16 == 0 else []  # NUM_SETS * WAYS
        divisible = list(range(12)) + [i for i, f in zip((12, 13), flags, strict=True) if f] + capacity
        compile_for_sm90(tc.cache_lookup_kernel, signature(LOOKUP_ARGS, types), const, divisible, 4)


def test_cache_commit_compiles():
    for divisible in (list(range(7)), list(range(8))):
        compile_for_sm90(tc.cache_commit_kernel, COMMIT, {"BLOCK": 256}, divisible, 4)
