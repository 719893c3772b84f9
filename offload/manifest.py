"""The NVMe tier's manifest: which slots hold a page, each page's checksum and its owner's page id.

An append-only msgpack stream in one file: a header map, then records
`["put", [slots], [crcs], [page ids]]` and `["del", [slots]]`, each flushed when written. A
restarted store replays it; a record torn by a crash (the tail) is dropped,
which loses only pages whose write had not been acknowledged. On open the log
is compacted to the header plus one "put" record (written aside, then renamed).
"""

from __future__ import annotations

import os

import msgpack

FORMAT_VERSION = 2  # 2: a page id per slot (an NVMe slot no longer equals its page's id)


class ManifestError(RuntimeError):
    """The manifest is unreadable or was written for a different layout."""


def _replay(path: str) -> tuple[dict, dict[int, tuple[int, int]]]:
    """Read header and entries {slot: (crc, page id)}; drop a torn tail record."""
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        try:
            header = next(unpacker)
        except (StopIteration, ValueError, msgpack.UnpackException) as e:
            raise ManifestError(f"manifest {path} has no readable header: {e!r}") from e
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
            raise ManifestError(f"manifest {path}: header {header!r} is not format {FORMAT_VERSION}")
        entries: dict[int, tuple[int, int]] = {}
        try:
            for record in unpacker:
                _apply(entries, record, path)
        except (ValueError, msgpack.UnpackException):
            pass  # torn tail: the crash happened while appending this record
    return header, entries


def _apply(entries: dict[int, tuple[int, int]], record, path: str) -> None:
    if record[0] == "put":
        entries.update(zip(record[1], zip(record[2], record[3], strict=True), strict=True))
    elif record[0] == "del":
        for s in record[1]:
            entries.pop(s, None)
    else:
        raise ManifestError(f"manifest {path}: unknown record {record[0]!r}")


class Manifest:
    """slot -> (crc32 of the page stored there, its page id), persisted as an append-only log."""

    def __init__(self, path: str, header: dict):
        self.path = path
        self.header = header
        self.entries: dict[int, tuple[int, int]] = {}
        if os.path.exists(path):
            found, self.entries = _replay(path)
            _check_header(path, found, header)
        self._compact()
        self._file = open(path, "ab")  # noqa: SIM115 (held open for appends until close)

    def _compact(self) -> None:
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(self.header))
            slots = sorted(self.entries)
            crcs, pages = ([self.entries[s][i] for s in slots] for i in (0, 1))
            f.write(msgpack.packb(["put", slots, crcs, pages]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _append(self, record: list) -> None:
        self._file.write(msgpack.packb(record))
        self._file.flush()

    def put(self, slots: list[int], crcs: list[int], pages: list[int]) -> None:
        self._append(["put", slots, crcs, pages])
        self.entries.update(zip(slots, zip(crcs, pages, strict=True), strict=True))

    def drop(self, slots: list[int]) -> None:
        self._append(["del", slots])
        for s in slots:
            self.entries.pop(s, None)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _check_header(path: str, found: dict, expected: dict) -> None:
    for key, value in expected.items():
        if found.get(key) != value:
            raise ManifestError(
                f"manifest {path} was written with {key}={found.get(key)!r}, this store has {key}={value!r}"
            )
