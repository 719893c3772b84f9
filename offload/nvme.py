"""The `nvme` tier: page files on local disk, a spill/promote tier below `host`.

Layout: slot s lives in file `pages-<s // slots_per_file>.bin` at offset
`(s % slots_per_file) * stride`, stride = slot bytes rounded up to 4 KiB, so
every page is an aligned O_DIRECT transfer. A batch is staged in one aligned
buffer, sorted, cut into runs of consecutive slots (one pread/pwrite each, at
most `max_run_bytes`), and the runs go to a thread pool in one part per thread.
Every page has a crc32 in the manifest, checked on read, and the page id its owner gave it (a
restarted PageStore finds which page each slot holds from the manifest alone).
Where the filesystem refuses O_DIRECT (tmpfs) buffered I/O is used and
`direct_io` is False. The GPU never reads this tier: pages are promoted to
`host` first.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .arena import PageGeometry, PageTier, as_slot_tensor, check_pages, check_slots_in_range
from .manifest import FORMAT_VERSION, Manifest

ALIGN = 4096  # O_DIRECT alignment of buffer, offset and length (covers 512 B and 4 KiB sectors)
MANIFEST_NAME = "manifest.msgpack"


class PageChecksumError(RuntimeError):
    """A page read from disk does not match its manifest checksum."""


class PageFileMissingError(RuntimeError):
    """The manifest lists a page whose file is gone or too short."""


class PageNotStoredError(LookupError):
    """A read asked for a slot that holds no page."""


def probe_direct_io(directory: str) -> bool:
    """True if files in directory accept O_DIRECT reads and writes (tmpfs does not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, f".direct-io-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory, page-aligned as O_DIRECT requires."""
    return mmap.mmap(-1, max(nbytes, 1))


def _runs(slots: list[int], per_file: int, max_run: int) -> list[tuple[int, int]]:
    """(first index, length) of runs of consecutive slots in one file, at most max_run long."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        end = i == len(slots)
        if end or slots[i] != slots[i - 1] + 1 or slots[i] % per_file == 0 or i - start == max_run:
            runs.append((start, i - start))
            start = i
    return runs


def _split(runs: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """Runs cut into at most `parts` contiguous groups of about equal pages."""
    total = sum(m for _, m in runs)
    out, cur, size = [], [], 0
    for run in runs:
        cur.append(run)
        size += run[1]
        if size * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
    return out + [cur] if cur else out


class NvmeTier(PageTier):
    """Pages in files under `directory`; reopening the directory finds them via the manifest."""

    def __init__(
        self,
        geometry: PageGeometry,
        directory: str,
        num_slots: int,
        *,
        slots_per_file: int = 65536,
        io_threads: int = 4,
        max_run_bytes: int = 4 << 20,
        verify_on_open: bool = True,
    ):
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be > 0")
        if slots_per_file <= 0 or io_threads <= 0:
            raise ValueError(f"slots_per_file ({slots_per_file}) and io_threads ({io_threads}) must be > 0")
        self.geometry, self.directory, self._num_slots = geometry, directory, num_slots
        self.stride = -(-geometry.slot_bytes // ALIGN) * ALIGN
        self.slots_per_file = slots_per_file
        self._max_run = max(1, max_run_bytes // self.stride)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.direct_io = probe_direct_io(directory)
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        # The manifest's log and maps: a spill written behind (offload/store.py) puts from its
        # writer thread while the owner's thread reads, discards or writes.
        self._manifest_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-io")
        self._threads = io_threads
        self.bytes_written = self.bytes_read = 0
        header = {
            "format": FORMAT_VERSION,
            "geometry": geometry.to_dict(),
            "num_slots": num_slots,
            "slots_per_file": slots_per_file,
            "stride": self.stride,
        }
        self._manifest = Manifest(os.path.join(directory, MANIFEST_NAME), header)
        self._closed = False
        self._check_files()
        if verify_on_open:
            self.verify()

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def bytes_resident(self) -> int:
        return len(self._manifest.entries) * self.geometry.slot_bytes

    def stored_slots(self) -> torch.Tensor:
        """`[k]` int64, sorted: the slots that hold a page (after a restart: the ones found)."""
        with self._manifest_lock:
            return torch.tensor(sorted(self._manifest.entries), dtype=torch.int64)

    def stored_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(slots [k], page ids [k])` int64, slots sorted: what each stored slot holds, by the
        page ids given to `write`."""
        with self._manifest_lock:
            slots = sorted(self._manifest.entries)
            pages = [self._manifest.entries[s][1] for s in slots]
        return torch.tensor(slots, dtype=torch.int64), torch.tensor(pages, dtype=torch.int64)

    def file_path(self, slot: int) -> str:
        return os.path.join(self.directory, f"pages-{slot // self.slots_per_file:05d}.bin")

    def _offset(self, slot: int) -> int:
        return (slot % self.slots_per_file) * self.stride

    def _check_files(self) -> None:
        """Every manifest entry's file exists and reaches its page (else PageFileMissingError)."""
        sizes: dict[str, int] = {}
        for slot in sorted(self._manifest.entries):
            path = self.file_path(slot)
            if path not in sizes:
                sizes[path] = os.path.getsize(path) if os.path.exists(path) else -1
            if sizes[path] < 0:
                raise PageFileMissingError(
                    f"nvme page slot {slot} is in the manifest but its file {path} is gone"
                )
            if sizes[path] < self._offset(slot) + self.stride:
                raise PageFileMissingError(
                    f"nvme page slot {slot}: file {path} has {sizes[path]} bytes, too short for its page"
                )

    def _fd(self, slot: int, create: bool) -> int:
        file_no = slot // self.slots_per_file
        with self._fd_lock:
            if file_no not in self._fds:
                path = self.file_path(slot)
                flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
                if create:
                    flags |= os.O_CREAT
                elif not os.path.exists(path):
                    raise PageFileMissingError(f"nvme page slot {slot}: file {path} is gone")
                self._fds[file_no] = os.open(path, flags, 0o600)
            return self._fds[file_no]

    def _checked(self, slots, name: str = "slots") -> torch.Tensor:
        if self._closed:
            raise RuntimeError("NvmeTier is closed")
        t = as_slot_tensor(slots, name)
        check_slots_in_range(t, self._num_slots, name)
        if t.numel() != torch.unique(t).numel():
            raise ValueError(f"{name} must be distinct, got {t.tolist()[:16]}")
        return t

    def write(self, slots, pages: torch.Tensor, page_ids=None, rows=None) -> None:
        """Store pages at slots `[n]`, recorded as page ids `[n]` (default: the slots); returns after
        the data and manifest are written. Slot i gets pages[i] (pages `[n, 2, B, d]`), or with
        rows `[n]` pages[rows[i]] of any `[m, 2, B, d]` (a spill passes the host arena and the
        pages' host slots: the I/O threads gather them straight into the aligned buffer, one copy)."""
        t = self._checked(slots)
        n = t.numel()
        if rows is None:
            check_pages(pages, n, self.geometry)
            rows = torch.arange(n)
        else:
            check_pages(pages, pages.shape[0], self.geometry)
            rows = as_slot_tensor(rows, "rows")
            check_slots_in_range(rows, pages.shape[0], "rows")
        ids = t if page_ids is None else as_slot_tensor(page_ids, "page_ids")
        for name, given in (("page_ids", ids), ("rows", rows)):
            if given.shape != t.shape:
                raise ValueError(f"{name}: expected shape {tuple(t.shape)} (one per slot), "
                                 f"got {tuple(given.shape)}")
        if n == 0:
            return
        order = torch.argsort(t)
        sorted_slots, rows = t[order].tolist(), rows[order]
        src = pages.detach().to("cpu")
        src = src.contiguous().view(src.shape[0], -1).view(torch.uint8)  # [m, sb] (a view of an arena)
        sb = src.shape[1]
        buf = _aligned_buffer(n * self.stride)  # the whole batch staged at once: [n, stride]
        view, crcs = memoryview(buf), [0] * n

        def stage(first: int, end: int) -> None:  # pages first .. end - 1 of the batch, on an I/O thread
            # NOTE: inference mode is per thread; the view is made here (an engine step's tensors are
            # inference tensors, which a thread outside that mode may not update in place).
            with torch.inference_mode():
                part = torch.frombuffer(view[first * self.stride : end * self.stride], dtype=torch.uint8)
                part = part.view(end - first, self.stride)
                if self.stride == sb:
                    torch.index_select(src, 0, rows[first:end], out=part)
                else:
                    part[:, :sb] = src.index_select(0, rows[first:end])

        self._in_parts(sorted_slots, lambda i, m: self._write_run(sorted_slots[i], view, i, m, crcs), stage)
        with self._manifest_lock:
            self._manifest.put(sorted_slots, crcs, ids[order].tolist())
            self.bytes_written += n * self.geometry.slot_bytes

    def _in_parts(self, sorted_slots: list[int], run: Callable[[int, int], None],
                  stage: Callable[[int, int], None] | None = None) -> None:
        """run(first index, length) for every run of consecutive slots, the runs split into one
        contiguous part per I/O thread: a future per thread, not per run (a batch of random pages is
        runs of one page each; a future and a buffer apiece cost more than the page's I/O). stage
        (first index, end) is called on the thread for its part's pages before their runs."""
        runs = _runs(sorted_slots, self.slots_per_file, self._max_run)
        parts = _split(runs, self._threads)

        def do(part: list[tuple[int, int]]) -> None:
            if stage is not None:
                stage(part[0][0], part[-1][0] + part[-1][1])
            for i, m in part:
                run(i, m)

        futures = [self._pool.submit(do, part) for part in parts]
        for f in futures:
            f.result()

    def _write_run(self, first_slot: int, view: memoryview, i: int, m: int, crcs: list[int]) -> None:
        # view: the staged batch [n * stride]; pages i .. i + m - 1 go to slots first_slot, ...
        sb, chunk = self.geometry.slot_bytes, view[i * self.stride : (i + m) * self.stride]
        fd, offset, done = self._fd(first_slot, create=True), self._offset(first_slot), 0
        while done < len(chunk):
            done += os.pwrite(fd, chunk[done:], offset + done)
        for j in range(m):
            crcs[i + j] = zlib.crc32(chunk[j * self.stride : j * self.stride + sb])

    def read(self, slots) -> torch.Tensor:
        """Pages `[n, 2, B, d]` (CPU) of slots `[n]`, each checked against its manifest crc."""
        t = self._checked(slots)
        missing = [s for s in t.tolist() if s not in self._manifest.entries]
        if missing:
            raise PageNotStoredError(f"nvme slots {missing[:16]} hold no page (not in the manifest)")
        n, sb = t.numel(), self.geometry.slot_bytes
        if n == 0:
            return torch.empty(0, *self.geometry.page_shape, dtype=self.geometry.dtype)
        order = torch.argsort(t)
        sorted_slots = t[order].tolist()
        buf = _aligned_buffer(n * self.stride)  # every run reads into its part of one buffer
        view = memoryview(buf)
        self._in_parts(sorted_slots, lambda i, m: self._read_run(sorted_slots[i : i + m], view, i))
        out = torch.empty((n, sb), dtype=torch.uint8)
        out[order] = torch.frombuffer(buf, dtype=torch.uint8).view(n, self.stride)[:, :sb]
        with self._manifest_lock:
            self.bytes_read += n * sb
        return out.view(self.geometry.dtype).view(n, *self.geometry.page_shape)

    def _read_run(self, slots: list[int], view: memoryview, i: int) -> None:
        # reads consecutive slots into pages i .. i + len(slots) - 1 of view, checksums verified
        sb, chunk = self.geometry.slot_bytes, view[i * self.stride : (i + len(slots)) * self.stride]
        fd, offset, done = self._fd(slots[0], create=False), self._offset(slots[0]), 0
        while done < len(chunk):
            got = os.preadv(fd, [chunk[done:]], offset + done)
            if got == 0:
                raise PageFileMissingError(
                    f"nvme page slot {slots[0]}: file {self.file_path(slots[0])} is short"
                )
            done += got
        for j, slot in enumerate(slots):
            crc = zlib.crc32(chunk[j * self.stride : j * self.stride + sb])
            expected = self._manifest.entries[slot][0]
            if crc != expected:
                raise PageChecksumError(
                    f"nvme page slot {slot} in {self.file_path(slot)} at offset {self._offset(slot)}: "
                    f"crc32 {crc:#010x} != manifest {expected:#010x}"
                )

    def verify(self, batch: int = 4096) -> int:
        """Read every stored page and check its checksum; return how many were checked."""
        with self._manifest_lock:
            slots = sorted(self._manifest.entries)
        for i in range(0, len(slots), batch):
            self.read(slots[i : i + batch])
        return len(slots)

    def discard(self, slots) -> None:
        """Forget pages (their bytes stay in the file until the slot is written again)."""
        t = self._checked(slots).tolist()
        with self._manifest_lock:
            self._manifest.drop([s for s in t if s in self._manifest.entries])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._manifest.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
