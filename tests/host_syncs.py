"""Host synchronisations found on the CPU: what would make a CUDA-graph capture of the same code fail.

On CUDA a decode step captured in a graph must not wait on the device: no `.item()`, `bool(t)`,
`int(t)`, `.tolist()`, `.cpu()`, `.numpy()`, and no op whose output size depends on the data
(`nonzero`, boolean indexing, `masked_select`, `unique`, `repeat_interleave` without
`output_size`, `torch.equal`). On the CPU none of them waits, so a CPU run proves nothing by
itself; `host_syncs()` records every one of them in the code it wraps (torch-function mode for the
tensor methods, dispatch mode for the ops), with the project's frames that called it.

    with host_syncs() as found:
        runner._forward_decode(key)
    assert not found, found.report()
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
    aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
}  # fmt: skip
SYNC_METHODS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
}  # fmt: skip
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
PROJECT_AREAS = ("kernels/", "offload/", "workers/", "cluster/")


@dataclass
class Found:
    """The host syncs seen: (what, the innermost project frames that led to it)."""

    syncs: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def add(self, what: str) -> None:
        frames = [f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack() if _ours(f.filename)]
        self.syncs.append((what, tuple(frames[-3:])))

    def __bool__(self) -> bool:
        return bool(self.syncs)

    def __len__(self) -> int:
        return len(self.syncs)

    def report(self) -> str:
        counts: dict[tuple[str, tuple[str, ...]], int] = {}
        for key in self.syncs:
            counts[key] = counts.get(key, 0) + 1
        return "\n".join(f"{n} x {what} at {' <- '.join(reversed(frames)) or '?'}"
                         for (what, frames), n in counts.items())


def _ours(filename: str) -> bool:
    return "site-packages" not in filename and any(f"/{area}" in filename for area in PROJECT_AREAS)


class _Methods(TorchFunctionMode):
    def __init__(self, found: Found):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_METHODS:
            self.found.add(func.__name__)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, found: Found):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.found.add(str(func))
        elif func in INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                       for i in (args[1] or ()) if i is not None):
            self.found.add(f"{func} with a boolean index")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_syncs():
    """Record the host syncs of the code inside (this thread only)."""
    found = Found()
    with _Methods(found), _Ops(found):
        yield found
