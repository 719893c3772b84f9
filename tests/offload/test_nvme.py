"""NVMe tier: real files, O_DIRECT where the filesystem allows it, checksums, the manifest."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.manifest import ManifestError
from lockserve.offload.nvme import (
    NvmeTier,
    PageChecksumError,
    PageFileMissingError,
    PageNotStoredError,
    _runs,
    _split,
    probe_direct_io,
)

from tests.offload.conftest import bits

GEOMETRY = PageGeometry(16, 128, torch.bfloat16)


def random_pages(n: int, seed: int, geometry: PageGeometry = GEOMETRY) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *geometry.page_shape), generator=g).to(geometry.dtype)



@pytest.mark.parametrize("geometry", [GEOMETRY, PageGeometry(16, 24, torch.float16)])  # 1.5 KiB: padded
def test_round_trip_across_files_and_runs(tmp_path, geometry):
    tier = NvmeTier(
        geometry, str(tmp_path / "nvme"), 200, slots_per_file=16, io_threads=3, max_run_bytes=5 * 4096
    )
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(200, generator=g)[:97]  # runs cut by files, gaps and the run cap
    pages = random_pages(97, 1, geometry)
    tier.write(slots, pages)
    assert tier.bytes_resident == 97 * geometry.slot_bytes
    back = tier.read(slots.flip(0))
    assert torch.equal(bits(back), bits(pages.flip(0)))
    assert torch.equal(tier.stored_slots(), slots.sort().values)
    tier.close()


@pytest.mark.parametrize("geometry", [GEOMETRY, PageGeometry(16, 24, torch.float16)])  # 1.5 KiB: padded
def test_write_with_rows_gathers_from_a_larger_tensor(tmp_path, geometry):
    """rows: slot i gets pages[rows[i]] of a bigger tensor (a spill passes the host arena), the
    same bytes as writing the gathered pages; ids, rows and slots stay paired whatever the order."""
    tier = NvmeTier(geometry, str(tmp_path / "nvme"), 200, slots_per_file=16, io_threads=3,
                    max_run_bytes=5 * 4096)
    g = torch.Generator().manual_seed(3)
    arena = random_pages(150, 2, geometry)
    slots = torch.randperm(200, generator=g)[:61]
    rows = torch.randperm(150, generator=g)[:61]
    with torch.inference_mode():  # as an engine step spills: its tensors are inference tensors
        tier.write(slots, arena.clone(), page_ids=slots + 1000, rows=rows.clone())
    assert torch.equal(bits(tier.read(slots)), bits(arena[rows]))
    found, ids = tier.stored_pages()
    assert torch.equal(ids, found + 1000), "each slot records its own page id"
    with pytest.raises(ValueError, match=r"rows holds 150, outside \[0, 150\)"):
        tier.write([1], arena, rows=[150])
    with pytest.raises(ValueError, match=r"rows: expected shape \(2,\) \(one per slot\), got \(1,\)"):
        tier.write([1, 2], arena, rows=[0])
    tier.close()


@pytest.mark.parametrize("parts", [1, 3, 4, 50])
def test_runs_split_into_contiguous_parts_of_about_equal_pages(parts):
    """A batch's runs go to the I/O threads in at most `parts` contiguous groups: every run once, in
    order, and no group more than one run above an equal share of the pages."""
    g = torch.Generator().manual_seed(parts)
    slots = sorted(torch.randperm(400, generator=g)[:150].tolist() + list(range(400, 430)))  # gaps, a run
    runs = _runs(slots, per_file=64, max_run=8)
    groups = _split(runs, parts)
    assert [r for grp in groups for r in grp] == runs and 1 <= len(groups) <= parts
    share, longest = len(slots) / parts, max(m for _, m in runs)
    assert all(sum(m for _, m in grp) <= share + longest for grp in groups), groups
    assert _split([], parts) == []


def test_empty_batches_write_and_read_nothing(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path / "nvme"), 8)
    tier.write(torch.empty(0, dtype=torch.int64), random_pages(0, 0))
    assert tier.read([]).shape == (0, *GEOMETRY.page_shape) and tier.bytes_resident == 0
    tier.close()


def test_direct_io_flag_reflects_the_filesystem(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path / "nvme"), 8)
    assert tier.direct_io == probe_direct_io(str(tmp_path))
    tier.write([3, 4], random_pages(2, 2))
    assert torch.equal(bits(tier.read([4, 3])), bits(random_pages(2, 2).flip(0)))
    tier.close()


def test_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (tmpfs before Linux 6.6) answers open() with EINVAL."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    tier = NvmeTier(GEOMETRY, str(tmp_path), 8)
    assert tier.direct_io is False
    tier.write([3, 4], random_pages(2, 2))
    assert torch.equal(bits(tier.read([4, 3])), bits(random_pages(2, 2).flip(0)))
    tier.close()


def test_flipped_byte_is_a_checksum_error_naming_page_and_file(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path), 64, slots_per_file=32)
    tier.write(torch.arange(40), random_pages(40, 3))
    tier.close()
    path = tmp_path / "pages-00001.bin"
    offset = (37 % 32) * 8192 + 1234  # inside slot 37's page
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(PageChecksumError, match=r"nvme page slot 37 in .*pages-00001.bin at offset 40960"):
        NvmeTier(GEOMETRY, str(tmp_path), 64, slots_per_file=32)  # verify_on_open reads every page
    tier = NvmeTier(GEOMETRY, str(tmp_path), 64, slots_per_file=32, verify_on_open=False)
    assert torch.equal(bits(tier.read([36, 38])), bits(random_pages(40, 3)[[36, 38]]))
    with pytest.raises(PageChecksumError, match="slot 37"):
        tier.read([36, 37])
    tier.close()


def test_restart_finds_pages_via_manifest(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path), 100, slots_per_file=8)
    tier.write([5, 6, 70], random_pages(3, 4))
    tier.write([90, 6], random_pages(2, 5))  # overwrite slot 6
    tier.discard([5])
    tier.close()
    again = NvmeTier(GEOMETRY, str(tmp_path), 100, slots_per_file=8)
    assert again.stored_slots().tolist() == [6, 70, 90]
    expected = torch.stack([random_pages(2, 5)[1], random_pages(3, 4)[2], random_pages(2, 5)[0]])
    assert torch.equal(bits(again.read([6, 70, 90])), bits(expected))
    with pytest.raises(PageNotStoredError, match=r"nvme slots \[5\] hold no page"):
        again.read([5])
    again.close()


def test_torn_manifest_tail_drops_only_the_unacknowledged_record(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path), 10)
    tier.write([1], random_pages(1, 6))
    tier.write([2], random_pages(1, 7))
    tier.close()
    manifest = tmp_path / "manifest.msgpack"
    manifest.write_bytes(manifest.read_bytes()[:-3])  # the crash cut the last record
    again = NvmeTier(GEOMETRY, str(tmp_path), 10)
    assert again.stored_slots().tolist() == [1]
    assert torch.equal(bits(again.read([1])), bits(random_pages(1, 6)))
    again.close()


def test_manifest_entry_whose_file_is_gone(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path), 40, slots_per_file=16)
    tier.write([3, 20], random_pages(2, 8))
    tier.close()
    os.unlink(tmp_path / "pages-00001.bin")
    with pytest.raises(
        PageFileMissingError, match=r"slot 20 is in the manifest but its file .*pages-00001.bin is gone"
    ):
        NvmeTier(GEOMETRY, str(tmp_path), 40, slots_per_file=16)


def test_truncated_file_and_deleted_after_open(tmp_path):
    tier = NvmeTier(GEOMETRY, str(tmp_path), 40, slots_per_file=16)
    tier.write([3, 9], random_pages(2, 9))
    tier.close()
    os.truncate(tmp_path / "pages-00000.bin", 9 * 8192 + 100)
    with pytest.raises(
        PageFileMissingError, match=r"slot 9: file .*pages-00000.bin has 73828 bytes, too short"
    ):
        NvmeTier(GEOMETRY, str(tmp_path), 40, slots_per_file=16)


def test_layout_mismatch_and_bad_arguments(tmp_path):
    NvmeTier(GEOMETRY, str(tmp_path), 40).close()
    with pytest.raises(ManifestError, match=r"num_slots=40, this store has num_slots=41"):
        NvmeTier(GEOMETRY, str(tmp_path), 41)
    with pytest.raises(ManifestError, match="geometry"):
        NvmeTier(PageGeometry(16, 64, torch.bfloat16), str(tmp_path), 40)
    tier = NvmeTier(GEOMETRY, str(tmp_path), 40)
    with pytest.raises(ValueError, match=r"slots holds 40, outside \[0, 40\)"):
        tier.write([40], random_pages(1, 0))
    with pytest.raises(ValueError, match="distinct"):
        tier.write([1, 1], random_pages(2, 0))
    with pytest.raises(ValueError, match=r"pages: expected shape \(2, 2, 16, 128\), got \(1, 2, 16, 128\)"):
        tier.write([1, 2], random_pages(1, 0))
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.read([1])
