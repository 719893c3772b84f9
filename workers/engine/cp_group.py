"""The ranks of one sharded request as a torch.distributed process group, and what its collectives cost.

    host = GroupHost.start(node_ip, timeout_s)      # on rank 0: a TCP rendezvous on a free port
    group = RankGroup.connect(host.address, rank, size, device, timeout_s, node_ip)   # on every rank
    gathered = group.all_gather(t)                  # [size, *t.shape]; rank order

gloo on CPU tensors, NCCL on CUDA tensors: the backend follows the device, nothing else changes.
A group is made per request (its ranks are chosen at admission); the process group objects are
built directly (no `init_process_group`), so one process can belong to several groups at once and
a request's group dies with it. A peer that dies makes gloo fail the waiting collective at once
(its sockets close); a peer that stops answering fails it after `timeout_s`.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
PHASES = ("prefill", "decode", "control")  # control: anything outside a forward (benchmarks)


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


class GroupHost:
    """Rank 0's end of a group's rendezvous: a TCPStore on a port the OS picks (never a fixed port:
    several groups and servers share nodes). Keep it alive until every rank has connected."""

    def __init__(self, store: dist.TCPStore, host: str):
        self.store, self.host = store, host

    @classmethod
    def start(cls, host: str, timeout_s: float) -> GroupHost:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        return cls(store, host)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.store.port


@dataclass
class CollectiveTimes:
    """Collectives issued and the seconds the host spent in them (eager steps; on CUDA the host
    only enqueues, so CUDA events time the device side instead: `RankGroup.drain_times`)."""

    calls: int = 0
    seconds: float = 0.0
    bytes_sent: int = 0


class RankGroup:
    """One request's ranks (see the module docstring). Use `connect` or `local` (tests)."""

    def __init__(self, pg, rank: int, size: int, device: torch.device):
        self.pg, self.rank, self.size, self.device = pg, rank, size, device
        self.phase = "prefill"  # the counters collectives go to: "prefill", "decode" or "control"
        self.capturing = False  # a CUDA graph is being captured: collectives are recorded, not timed
        self.times = {name: CollectiveTimes() for name in PHASES}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @classmethod
    def connect(cls, address: tuple[str, int], rank: int, size: int, device: torch.device, timeout_s: float,
                node_ip: str, store: dist.Store | None = None, prefix: str = "") -> RankGroup:
        """Join a group through rank 0's GroupHost at `address` (rank 0 passes its own store).
        node_ip: the address this rank's gloo sockets bind (the node's, as Ray knows it)."""
        if store is None:
            host, port = address
            store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        pg = _process_group(dist.PrefixStore(prefix or "g", store), rank, size, device, timeout_s, node_ip)
        return cls(pg, rank, size, device)

    @classmethod
    def solo(cls, device: torch.device) -> RankGroup:
        """A group of one rank (no process group): the context-parallel path on one device, whose
        collectives are copies; what it costs over the plain engine is the path's own overhead."""
        return cls(None, 0, 1, device)

    @classmethod
    def local(cls, store: dist.Store, rank: int, size: int, timeout_s: float = 60.0) -> RankGroup:
        """A gloo group over an in-process store (threads as ranks: tests)."""
        device = torch.device("cpu")
        return cls(_process_group(store, rank, size, device, timeout_s, "127.0.0.1"), rank, size, device)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape and dtype on all), [size, *t.shape], in rank order."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        times = self.times[self.phase]
        times.calls += 1
        times.bytes_sent += t.numel() * t.element_size()
        if t.is_cuda and self.capturing:
            self._gather_into(out, t)
        elif t.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._gather_into(out, t)
            end.record()
            self._events.append((self.phase, start, end))
        else:
            begin = time.perf_counter()
            self._gather_into(out, t)
            times.seconds += time.perf_counter() - begin
        return out

    def _gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self.size == 1:  # NOTE: still a copy: one rank runs (and measures) the code of many
            out[0] = t
        else:
            self.pg._allgather_base(out.view(-1), t.view(-1)).wait()

    def drain_times(self) -> dict[str, CollectiveTimes]:
        """The counters by phase, with the CUDA-event times of enqueued collectives added (waits for
        them on CUDA: call it outside the step)."""
        for phase, start, end in self._events:
            end.synchronize()
            self.times[phase].seconds += start.elapsed_time(end) / 1e3
        self._events.clear()
        return self.times

    def close(self) -> None:
        """Drop the process group (a broken one included). Idempotent."""
        pg, self.pg = self.pg, None
        # NCCL: abort, which does not wait for work a dead peer will never finish; gloo: shutdown
        # (it closes the sockets, so the peers' pending collectives fail at once)
        method = "abort" if backend_for(self.device) == "nccl" else "shutdown"
        if pg is not None and hasattr(pg, method):
            try:
                getattr(pg, method)()
            except Exception:  # a group whose peer died may refuse; it is dropped either way
                pass


def _process_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
                   node_ip: str):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip)]
    return dist.ProcessGroupGloo(store, rank, size, opts)
