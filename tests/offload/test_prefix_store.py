"""PrefixStore (offload/prefix_store.py): records by digest in segment files with an append-only
index; reopening finds them, capacity drops the least recently used segments, a bad byte or a
different layout is an error, files no record names are removed."""

from __future__ import annotations

import os

import pytest
import torch
from lockserve.offload.manifest import ManifestError
from lockserve.offload.prefix_store import PrefixRecordError, PrefixStore

PAGE_BYTES = 97  # awkward: no alignment assumed
INDEX = "prefix.index.msgpack"  # the default name's files


def records(first: int, n: int) -> torch.Tensor:
    """[n, PAGE_BYTES] uint8: record i's bytes are a function of i alone."""
    g = torch.Generator().manual_seed(first)
    return torch.randint(0, 256, (n, PAGE_BYTES), generator=g, dtype=torch.uint8)


def digests(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_records_come_back_after_reopen_in_any_split(tmp_path):
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, {"salt": "s"})
    a = records(1, 7)
    assert store.put(digests("a", 7), [a[:3], a[3:5], a[5:]]) == 7, "parts of any size"
    b = records(2, 4)
    assert store.put(digests("b", 4), [b]) == 4
    store.close()
    again = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, {"salt": "s"})
    assert again.match(digests("a", 7) + [b"zz"]) == 7 and again.match(digests("b", 5)) == 4
    # a read across segments and out of order
    want = torch.cat([a[5:], b[:2], a[:1]])
    got = again.read(digests("a", 7)[5:] + digests("b", 2) + digests("a", 1))
    assert torch.equal(got, want), "records read back bitwise"
    assert again.num_pages == 11 and again.bytes_used == 11 * PAGE_BYTES


def test_capacity_drops_least_recently_used_segments_and_keeps_a_leading_run(tmp_path):
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 10 * PAGE_BYTES)
    store.put(digests("a", 4), [records(1, 4)])
    store.put(digests("b", 4), [records(2, 4)])
    store.read(digests("a", 1))  # a is now the most recently used
    store.put(digests("c", 4), [records(3, 4)])  # 12 > 10: b goes
    assert store.match(digests("a", 4)) == 4 and store.match(digests("b", 1)) == 0
    assert store.match(digests("c", 4)) == 4 and store.bytes_used <= 10 * PAGE_BYTES
    assert store.put(digests("d", 14), [records(4, 14)]) == 10, "only the leading pages that fit"
    assert store.match(digests("d", 14)) == 10 and store.num_pages == 10
    assert sorted(os.listdir(tmp_path)) == [INDEX, "prefix.seg-00000003.bin"], "dropped segments' files go"
    assert PrefixStore(str(tmp_path / "none"), PAGE_BYTES, 0).put(digests("e", 2), [records(5, 2)]) == 0


def test_a_changed_byte_is_an_error_not_a_page(tmp_path):
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES)
    store.put(digests("a", 3), [records(1, 3)])
    path = tmp_path / "prefix.seg-00000000.bin"
    raw = bytearray(path.read_bytes())
    raw[PAGE_BYTES + 5] ^= 1  # record 1
    path.write_bytes(bytes(raw))
    assert torch.equal(store.read(digests("a", 1)), records(1, 3)[:1]), "record 0 is intact"
    with pytest.raises(PrefixRecordError, match="record 1: crc32"):
        store.read(digests("a", 3))


def test_a_read_is_cut_into_parts_for_the_reader_threads(tmp_path):
    """Runs of records cut into parts of 2 records on 3 threads: the records come back in the order
    asked, bitwise, and a bad byte in the middle of a long run is the error of that record."""
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, read_threads=3,
                        read_part_bytes=2 * PAGE_BYTES)
    a, b = records(1, 9), records(2, 5)
    store.put(digests("a", 9), [a])
    store.put(digests("b", 5), [b])
    ask = digests("b", 5)[1:] + digests("a", 9) + digests("b", 1)
    assert torch.equal(store.read(ask), torch.cat([b[1:], a, b[:1]])), "in the order asked, bitwise"
    path = tmp_path / "prefix.seg-00000000.bin"
    raw = bytearray(path.read_bytes())
    raw[6 * PAGE_BYTES + 1] ^= 1  # record 6 of a's run of 9: the fourth part
    path.write_bytes(bytes(raw))
    with pytest.raises(PrefixRecordError, match="record 6: crc32"):
        store.read(ask)
    store.close()


def test_another_layout_is_refused_and_unnamed_segments_are_removed(tmp_path):
    PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, {"salt": "s"}).close()
    with pytest.raises(ManifestError, match="page_bytes=97"):
        PrefixStore(str(tmp_path), PAGE_BYTES + 1, 100 * PAGE_BYTES, {"salt": "s"})
    with pytest.raises(ManifestError, match="salt='s'"):
        PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, {"salt": "t"})
    (tmp_path / "prefix.seg-00000007.bin").write_bytes(b"x" * PAGE_BYTES)  # written, never indexed
    (tmp_path / "other.seg-00000007.bin").write_bytes(b"x")  # another store's
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, {"salt": "s"})
    assert store.num_pages == 0 and sorted(os.listdir(tmp_path)) == ["other.seg-00000007.bin", INDEX]


def test_bad_input_is_refused(tmp_path):
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES)
    with pytest.raises(ValueError, match=r"expected uint8 \[k, 97\]"):
        store.put(digests("a", 2), [torch.zeros(2, 96, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="parts held 1 records for 2 digests"):
        store.put(digests("a", 2), [records(1, 1)])
    assert store.num_pages == 0 and sorted(os.listdir(tmp_path)) == [INDEX], "a failed put: no file"
    store.put(digests("a", 1), [records(1, 1)])
    with pytest.raises(ValueError, match="stored already"):
        store.put(digests("a", 1), [records(1, 1)])


@pytest.mark.parametrize("depth", [1, 3])
def test_parts_written_on_threads_keep_their_order_and_a_failed_put_leaves_no_file(tmp_path, depth):
    """A put writes and checksums its parts on the I/O threads, `depth` at once: the records read
    back in order; a producer that fails halfway leaves no segment file and no record."""
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, write_depth=depth)
    a = records(3, 20)
    assert store.put(digests("a", 20), [a[i : i + 3] for i in range(0, 20, 3)]) == 20
    assert torch.equal(store.read(digests("a", 20)), a)

    def failing():
        yield records(4, 5)
        yield records(5, 5)
        raise RuntimeError("the producer failed")

    before = sorted(os.listdir(tmp_path))
    with pytest.raises(RuntimeError, match="producer failed"):
        store.put(digests("b", 15), failing())
    assert sorted(os.listdir(tmp_path)) == before and store.match(digests("b", 15)) == 0
    store.close()


def test_each_part_starts_its_writeback_as_it_is_written(tmp_path, monkeypatch):
    """A put asks the kernel to write each part to disk as soon as it is written (so the segment's
    fsync waits for its last parts only): one POSIX_FADV_DONTNEED over each part's bytes, the
    parts tiling the segment; the records read back as given."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform: writeback is left to the fsync")
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (calls.append((off, n, advice)),
                                                                          real(fd, off, n, advice)))
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES, write_depth=2)
    a = records(6, 20)
    store.put(digests("a", 20), [a[i : i + 3] for i in range(0, 20, 3)])
    assert {advice for *_, advice in calls} == {os.POSIX_FADV_DONTNEED}
    assert sorted((off, n) for off, n, _ in calls) == [(i * PAGE_BYTES, min(3, 20 - i) * PAGE_BYTES)
                                                      for i in range(0, 20, 3)]
    assert torch.equal(store.read(digests("a", 20)), a)
    store.close()


def test_a_refused_writeback_hint_loses_nothing(tmp_path, monkeypatch):
    """Where the file system refuses the hint (OSError), the put still stores every record."""
    def refuse(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    store = PrefixStore(str(tmp_path), PAGE_BYTES, 100 * PAGE_BYTES)
    a = records(7, 5)
    assert store.put(digests("a", 5), [a[:2], a[2:]]) == 5
    assert torch.equal(store.read(digests("a", 5)), a)
    store.close()
