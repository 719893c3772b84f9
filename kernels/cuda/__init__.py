"""lockserve.kernels.cuda: CUDA C++ kernels compiled at first use by NVRTC (shipped with PyTorch's
CUDA wheels), for where Triton could not reach the memory-bound speed.

  score: score_pages_cuda, score_and_group_cuda (tensor-core LOCKS scoring of the shipped
         summary format; score_unsupported says why other inputs go to Triton)
The torch reference (kernels/score.py) defines what they compute; kernels/ops.py dispatches.
"""

from .score import score_and_group_cuda, score_pages_cuda, score_unsupported

__all__ = ["score_and_group_cuda", "score_pages_cuda", "score_unsupported"]
