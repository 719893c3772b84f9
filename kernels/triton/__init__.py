"""lockserve.kernels.triton: Triton fast paths of the LOCKS kernels.

Modules ending in `_kernel` hold only @triton.jit code; the launchers beside them validate
arguments (ValueError naming expected vs actual) and launch:
  score:     score_pages_triton, score_and_group_triton, share_average_triton, ScoreTuning
  attention: sparse_decode_triton, AttentionTuning
  prefill:   paged_prefill_triton (a prefill chunk over its pages where they lie, causal)
  fused:     add_rms_norm_triton, rope_write_triton, silu_mul_triton (decode-step fusions)
  select:    decode_selection_triton (keys kernel, torch.topk, slots kernel)
Use lockserve.kernels.ops for device dispatch (Triton on CUDA or under TRITON_INTERPRET=1).
"""

from .attention import AttentionTuning, sparse_decode_triton
from .fused import add_rms_norm_triton, rope_write_triton, silu_mul_triton
from .prefill import paged_prefill_triton
from .score import ScoreTuning, score_and_group_triton, score_pages_triton, share_average_triton
from .select import decode_selection_triton

__all__ = [
    "AttentionTuning",
    "ScoreTuning",
    "add_rms_norm_triton",
    "decode_selection_triton",
    "paged_prefill_triton",
    "rope_write_triton",
    "score_and_group_triton",
    "score_pages_triton",
    "share_average_triton",
    "silu_mul_triton",
    "sparse_decode_triton",
]
