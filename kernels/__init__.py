"""lockserve.kernels: LOCKS math — torch references, Triton kernels, baselines, metrics.

Reference (ground truth, pure torch):
  summary:   LocksConfig, build_summaries, quantize_summaries, dequantize_summaries
  score:     score_pages_ref (Eq. 4), exact_page_lse (oracle), group_scores (Eq. 5 and variants)
  select:    budget_pages, select_pages (sink + recent + top by group score), select_decode_pages and
             decode_selection_ref (a budget per row, fixed width: what a CUDA graph replays)
  attention: sparse_decode_ref, attention_ref, merge_partials, page_lengths, paged_prefill_ref (a
             prefill chunk over its pages, causal)
  fused:     add_rms_norm_ref, rope_write_ref, rotate_half_ref, silu_mul_ref (decode-step fusions)
Fast path: ``lockserve.kernels.ops`` (Triton on CUDA or under TRITON_INTERPRET=1).
Quality: ``lockserve.kernels.baselines`` (oracle, Quest, centroid, shared bases at matched
bytes) and ``lockserve.cluster.measure.eval.metrics`` (coverage, carrier retention, MAE, Spearman).
"""

from .attention import attention_ref, merge_partials, page_lengths, paged_prefill_ref, sparse_decode_ref
from .fused import add_rms_norm_ref, rope_write_ref, rotate_half_ref, silu_mul_ref
from .score import exact_page_lse, group_scores, score_pages_ref
from .select import budget_pages, select_pages
from .summary import (
    LocksConfig,
    PageSummaries,
    QuantSummaries,
    build_summaries,
    dequantize_summaries,
    quantize_summaries,
)

__all__ = [
    "LocksConfig",
    "PageSummaries",
    "QuantSummaries",
    "add_rms_norm_ref",
    "attention_ref",
    "budget_pages",
    "build_summaries",
    "dequantize_summaries",
    "exact_page_lse",
    "group_scores",
    "merge_partials",
    "page_lengths",
    "paged_prefill_ref",
    "quantize_summaries",
    "rope_write_ref",
    "rotate_half_ref",
    "score_pages_ref",
    "select_pages",
    "silu_mul_ref",
    "sparse_decode_ref",
]
