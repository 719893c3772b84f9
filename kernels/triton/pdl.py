"""Programmatic dependent launch (PDL): a kernel that starts while the one before it finishes.

Between two kernels of a CUDA graph the device idles for about a microsecond: the next grid is
launched, its programs placed and its arguments loaded only once the previous grid has ended.
With PDL (Hopper and later) a kernel launched with `launch_pdl=True` may start as soon as every
program of the kernel before it has called `griddepcontrol.launch_dependents` (or ended). Its
programs then run what does not depend on that kernel and wait in `griddepcontrol.wait`, which
returns once the previous grid has ended and its memory is visible.

Used on one edge only: the selection's slot kernel (it triggers as it starts) to the hot cache's
lookup (it loads its own tables, then waits for the slots). That is the launch the host tiers add
to a layer; the rest of the step keeps ordinary launches.

Invariants a PDL launch relies on:
- Every program of the dependent kernel calls `wait` before it reads anything the previous kernel
  writes, and before it writes anything a later kernel may read (the later kernel, launched
  normally, waits for this one, and so for everything before it).
- What a dependent program reads before its `wait` was written before the previous kernel began
  (the previous kernel itself was launched normally, after everything before it had ended).
- A trigger with no PDL launch after it does nothing, so the slot kernels trigger wherever PDL can
  run, whatever follows them.

`LOCKSERVE_PDL=0` turns it off (read at each launch): the A/B switch of the benchmarks.
"""

from __future__ import annotations

import functools
import os

import torch


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` may use PDL: a CUDA device of compute capability 9.0 or later
    (griddepcontrol is sm_90 PTX), compiled (the interpreter runs no PTX), not turned off."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("LOCKSERVE_PDL", "1") == "0":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch_options(enabled: bool) -> dict:
    """Launch keywords for a kernel that waits (`gdc_wait`) under PDL: none when off, so that
    Triton builds without the launch attribute (and the interpreter sees no unknown keyword)."""
    return {"launch_pdl": True} if enabled else {}
