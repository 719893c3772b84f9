"""`PrefixStore`: cached prefix pages kept on NVMe across restarts, named by their chain digests.

The engine's prefix cache (workers/engine/prefix_cache.py) names a full page by a digest of every
token up to it. On tier host+nvme its pages live in a volatile host arena (or spilled, under ids
that die with the process), so a copy of each cached page - its K/V of every layer and KV head and
its summary rows, one opaque record of `page_bytes` - is written here, and a restarted engine with
the same directory finds it by digest.

Layout in `directory` (shared with other files: every name starts with the store's `name`):
segment files `<name>.seg-<n>.bin`, each the records of one `put` (pages in the order given,
`page_bytes` apart), and an index `<name>.index.msgpack`: an append-only msgpack stream of a header
map, then records `["seg", file, [digests], [crc32 per page]]` and `["drop", [files]]`.

Crash safety (SIGKILL at any point): a segment's bytes are written and fsync'd before its "seg"
record is appended, and the record is one write; so the index never names a page that was not
written. A record torn by a crash is the log's tail and is dropped on replay; a segment file no
record names (killed before its record) is deleted on open; a "drop" record is appended before the
files are deleted. On open the log is compacted (written aside, fsync'd, renamed over the old one).
Every page is checked against its crc on read.

Threads: one writer may `put` while another thread calls the lookups and `read` (the engine
writes in the background: workers/engine/prefix_disk.py). The index's maps are changed and read
under one lock; a segment's bytes are written outside it, and its pages are found only once its
record is appended.

Capacity: at most `capacity_bytes` of records; a put drops whole segments, least recently read or
written first, to make room, and stores only the leading pages that fit. A held segment (`hold`:
the page store reads its records' K/V in place of spilled copies, offload/store.py) is never
dropped until every hold is released. A dropped segment in the
middle of a chain makes the pages after it unreachable (a match runs from page 0): they are never
read again and age out in turn.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import msgpack
import torch

from .manifest import ManifestError

FORMAT_VERSION = 1
INDEX_SUFFIX = ".index.msgpack"
READ_PART_BYTES = 64 << 20  # records a reader thread reads and checks at a time
WRITE_DEPTH = 4  # parts a put writes and checksums at once (each on an I/O thread)
SEGMENT_INFIX = ".seg-"


class PrefixRecordError(RuntimeError):
    """A stored page's bytes do not match its crc, or its segment is gone or short."""


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the disk write of fd's bytes [offset, offset + length) now, without waiting for it, so
    that a segment's final fsync waits only for its last parts (else the kernel holds a whole
    segment dirty in memory until that fsync writes it all: a put cost its production time plus the
    disk's). On Linux POSIX_FADV_DONTNEED starts the writeback of dirty pages (pages under
    writeback stay cached); elsewhere nothing. A hint: a file system that refuses it loses nothing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


@dataclass
class _Segment:
    name: str
    digests: list[bytes]
    crcs: list[int]


class PrefixStore:
    """Records of `page_bytes` by digest, in segment files under `directory` (see the module doc).

    header: plain data that must equal the one a previous store of this name was opened with (the
    record layout); a mismatch raises ManifestError naming the field. name: the start of every file
    name of this store in directory (files of other names are left alone). read_threads: threads
    a `read` reads and checks its records on, read_part_bytes at a time (crc32 runs at about 2 GB/s
    a thread in a CPU probe: a 128K document of the 8B shape is 18.9 GB of records); a `put` writes
    and checksums the parts its producer gives on the same threads, write_depth parts at once."""

    def __init__(self, directory: str, page_bytes: int, capacity_bytes: int, header: dict | None = None,
                 name: str = "prefix", read_threads: int = 8, read_part_bytes: int = READ_PART_BYTES,
                 write_depth: int = WRITE_DEPTH):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes ({page_bytes}) must be > 0")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must be >= 0")
        self.directory, self.page_bytes, self.capacity_bytes = directory, page_bytes, capacity_bytes
        self.name = name
        self.header = {"format": FORMAT_VERSION, "page_bytes": page_bytes, **(header or {})}
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._segments: OrderedDict[str, _Segment] = OrderedDict()  # least recently used first
        self._where: dict[bytes, tuple[str, int]] = {}  # digest -> (segment, index in it)
        self._next = 0
        self._held: dict[str, int] = {}  # segment -> holds (`hold`); never dropped while held
        self._lock = threading.RLock()  # the maps above and the index file (see the module doc)
        path = os.path.join(directory, name + INDEX_SUFFIX)
        if os.path.exists(path):
            self._replay(path)
        self._remove_unnamed_files()
        self._compact(path)
        self._index = open(path, "ab")  # noqa: SIM115 (held open for appends until close)
        self._readers = ThreadPoolExecutor(max(1, read_threads), thread_name_prefix="prefix-io")
        self._write_depth = max(1, write_depth)
        # Records a reader thread takes at a time: a segment's run is cut so that the threads share it.
        self._read_part = max(1, read_part_bytes // page_bytes)

    # ---- lookups ------------------------------------------------------------------------------

    @property
    def parts_held(self) -> int:
        """Parts of a producer's that a `put` may still hold (writing or checksumming) while the
        producer makes the next one: a producer may reuse a part's buffer once this many later
        parts were taken (at most write_depth in flight: `_write_segment` waits for the oldest)."""
        return self._write_depth

    @property
    def num_pages(self) -> int:
        return len(self._where)

    @property
    def bytes_used(self) -> int:
        return self.num_pages * self.page_bytes

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._where

    def match(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, are stored (the longest run)."""
        n = 0
        with self._lock:
            while n < len(digests) and digests[n] in self._where:
                n += 1
        return n

    def read(self, digests: Sequence[bytes]) -> torch.Tensor:
        """Records [n, page_bytes] uint8 of stored digests, each checked against its crc; their
        segments become the most recently used. Raises PrefixRecordError on a bad or missing page."""
        out = torch.empty((len(digests), self.page_bytes), dtype=torch.uint8)
        with self._lock:  # a put may not drop a segment being read
            self._read_runs(digests, out)
        return out

    def _read_runs(self, digests: Sequence[bytes], out: torch.Tensor) -> None:
        i, parts = 0, []
        while i < len(digests):  # runs of consecutive records of one segment: a pread each (or a few)
            name, first = self._where[digests[i]]
            m = 1
            while i + m < len(digests) and self._where.get(digests[i + m]) == (name, first + m):
                m += 1
            for j in range(0, m, self._read_part):  # read and checked on the reader threads
                k = min(m, j + self._read_part)
                parts.append((self._segments[name], first + j, out[i + j : i + k]))
            self._segments.move_to_end(name)
            i += m
        futures = [self._readers.submit(self._read_run, *part) for part in parts]
        wait(futures)  # every part done before the lock is let go (a put may then drop a segment)
        for f in futures:
            f.result()  # the first bad part's PrefixRecordError

    def _read_run(self, seg: _Segment, first: int, out: torch.Tensor) -> None:
        # out: [m, page_bytes] uint8, filled with records first .. first + m - 1 of seg
        path, want = os.path.join(self.directory, seg.name), out.numel()
        try:
            with open(path, "rb") as f:
                got = os.preadv(f.fileno(), [memoryview(out.numpy()).cast("B")], first * self.page_bytes)
        except FileNotFoundError as e:
            raise PrefixRecordError(f"prefix segment {path} is gone") from e
        if got != want:
            raise PrefixRecordError(f"prefix segment {path}: read {got} of {want} bytes at record {first}")
        for j in range(out.shape[0]):
            crc = zlib.crc32(out[j].numpy())
            if crc != seg.crcs[first + j]:
                raise PrefixRecordError(f"prefix segment {path} record {first + j}: crc32 {crc:#010x} != "
                                        f"index {seg.crcs[first + j]:#010x}")

    def hold(self, digests: Sequence[bytes]) -> dict[str, list[tuple[int, int]]]:
        """Where the records of stored digests are, by segment file path: [(index in digests, byte
        offset of its record)]; each segment returned is held (never dropped) until one
        `release(path)`. Raises KeyError naming a digest that is not stored."""
        out: dict[str, list[tuple[int, int]]] = {}
        with self._lock:
            for i, d in enumerate(digests):
                if d not in self._where:
                    raise KeyError(f"hold: digest {d.hex()[:16]} is not stored")
                name, j = self._where[d]
                out.setdefault(name, []).append((i, j * self.page_bytes))
            for name in out:
                self._held[name] = self._held.get(name, 0) + 1
        return {os.path.join(self.directory, name): where for name, where in out.items()}

    def release(self, path: str) -> None:
        """One hold of the segment at path (from `hold`) ends."""
        name = os.path.basename(path)
        with self._lock:
            left = self._held[name] - 1
            if left:
                self._held[name] = left
            else:
                del self._held[name]

    # ---- writes -------------------------------------------------------------------------------

    def put(self, digests: Sequence[bytes], parts: Iterable[torch.Tensor]) -> int:
        """Store records of `digests` (none stored yet), their bytes given in order by `parts`
        (uint8 [k, page_bytes] each, k >= 1, together one per digest; a producer may read them
        chunk by chunk). Only the leading pages that fit the capacity are stored (older segments
        dropped first); returns how many. Returns after the segment is on disk and indexed."""
        with self._lock:
            if any(d in self._where for d in digests):
                raise ValueError("put: a digest is stored already (check `in` first)")
            n = self._make_room(min(len(digests), self.capacity_bytes // self.page_bytes))
            if n == 0:
                return 0
            name = f"{self.name}{SEGMENT_INFIX}{self._next:08d}.bin"
            self._next += 1
        crcs = self._write_segment(os.path.join(self.directory, name), n, parts)  # outside the lock
        seg = _Segment(name, list(digests[:n]), crcs)
        with self._lock:
            self._append(["seg", name, seg.digests, crcs])  # only now does the index name its pages
            self._add(seg)
        return n

    def _write_segment(self, path: str, n: int, parts: Iterable[torch.Tensor]) -> list[int]:
        """Write the first n records of parts to a new file, fsync'd; their crcs. Each part is
        written and checksummed on an I/O thread (pwrite and crc32 let go of the GIL), at most
        write_depth at once, while the producer makes the next ones."""
        crcs: list[int] = []
        flying: deque[Future] = deque()  # parts in order: their crcs, once written
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            given = 0
            for part in parts:
                if part.dtype != torch.uint8 or part.dim() != 2 or part.shape[1] != self.page_bytes:
                    raise ValueError(f"parts: expected uint8 [k, {self.page_bytes}], got {part.dtype} "
                                     f"{tuple(part.shape)}")
                part = part[: n - given].contiguous()
                flying.append(self._readers.submit(self._write_checked, fd, given * self.page_bytes, part))
                given += part.shape[0]
                while len(flying) > self._write_depth:
                    crcs += flying.popleft().result()
                if given == n:
                    break
            while flying:
                crcs += flying.popleft().result()
            if len(crcs) != n:
                raise ValueError(f"parts held {len(crcs)} records for {n} digests")
            os.fsync(fd)
        except BaseException:
            wait(flying)  # none may write to the file after it is gone
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return crcs

    def _write_checked(self, fd: int, offset: int, part: torch.Tensor) -> list[int]:
        """Write part [k, page_bytes] at offset and start its writeback; the crc32 of each record."""
        self._write_part(fd, offset, part)
        start_writeback(fd, offset, part.numel())
        return [zlib.crc32(row.numpy()) for row in part]

    @staticmethod
    def _write_part(fd: int, offset: int, part: torch.Tensor) -> None:
        view, done = memoryview(part.numpy()).cast("B"), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def _make_room(self, n: int) -> int:
        """Drop least recently used segments, held ones spared, until n more records fit; returns
        how many fit (n, or fewer where held segments fill the rest)."""
        most = self.capacity_bytes // self.page_bytes - n
        dropped = []
        for name in [name for name in self._segments if name not in self._held]:  # oldest first
            if self.num_pages <= most:
                break
            for d in self._segments.pop(name).digests:
                del self._where[d]
            dropped.append(name)
        if dropped:
            self._append(["drop", dropped])  # before the files go: a record never outlives its file
            for name in dropped:
                os.unlink(os.path.join(self.directory, name))
        return max(0, min(n, self.capacity_bytes // self.page_bytes - self.num_pages))

    def _append(self, record: list) -> None:
        self._index.write(msgpack.packb(record))
        self._index.flush()

    def _add(self, seg: _Segment) -> None:
        self._segments[seg.name] = seg
        for j, d in enumerate(seg.digests):
            self._where[d] = (seg.name, j)

    # ---- open and close -----------------------------------------------------------------------

    def _replay(self, path: str) -> None:
        """Segments the index names (a torn tail record dropped), their files checked for size."""
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
            try:
                found = next(unpacker)
            except (StopIteration, ValueError, msgpack.UnpackException) as e:
                raise ManifestError(f"prefix index {path} has no readable header: {e!r}") from e
            for key, value in self.header.items():
                if not isinstance(found, dict) or found.get(key) != value:
                    got = found.get(key) if isinstance(found, dict) else found
                    raise ManifestError(f"prefix index {path} was written with {key}={got!r}, this store "
                                        f"has {key}={value!r}")
            try:
                for record in unpacker:
                    self._apply(record, path)
            except (ValueError, msgpack.UnpackException):
                pass  # torn tail: the crash happened while appending this record
        for name, seg in list(self._segments.items()):
            file = os.path.join(self.directory, name)
            size = os.path.getsize(file) if os.path.exists(file) else -1
            if size < len(seg.digests) * self.page_bytes:  # only after a power loss (fsync'd first)
                del self._segments[name]
                for d in seg.digests:
                    del self._where[d]

    def _apply(self, record, path: str) -> None:
        if record[0] == "seg":
            _, name, digests, crcs = record
            self._add(_Segment(name, list(digests), list(crcs)))
            self._next = max(self._next, self._number(name) + 1)
        elif record[0] == "drop":
            for name in record[1]:
                seg = self._segments.pop(name, None)
                for d in seg.digests if seg else ():
                    del self._where[d]
        else:
            raise ManifestError(f"prefix index {path}: unknown record {record[0]!r}")

    def _number(self, file: str) -> int:
        return int(file[len(self.name) + len(SEGMENT_INFIX) :].removesuffix(".bin"))

    def _remove_unnamed_files(self) -> None:
        """Segment files no record names: written by a store killed before it indexed them."""
        for file in os.listdir(self.directory):
            if file.startswith(self.name + SEGMENT_INFIX) and file not in self._segments:
                os.unlink(os.path.join(self.directory, file))

    def _compact(self, path: str) -> None:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(self.header))
            for seg in self._segments.values():
                f.write(msgpack.packb(["seg", seg.name, seg.digests, seg.crcs]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        with self._lock:
            if not self._index.closed:
                self._index.close()
