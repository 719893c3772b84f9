"""Shared-memory host arena: real POSIX shared memory, real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.host import DEFAULT_SHM_DIR, HostArena, remove_stale_segments
from lockserve.offload.store import PageStore

GEOMETRY = PageGeometry(16, 64, torch.bfloat16)
# fork is quick; spawn is a fresh interpreter whose exit runs atexit handlers (fork's does not).
FORK, SPAWN = mp.get_context("fork"), mp.get_context("spawn")



def random_pages(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *GEOMETRY.page_shape), generator=g).to(GEOMETRY.dtype)


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(DEFAULT_SHM_DIR) if n.startswith(prefix + "."))


def test_create_names_mode_and_close(prefix):
    a = HostArena.create(GEOMETRY, 13, prefix=prefix)
    b = HostArena.create(GEOMETRY, 13, prefix=prefix)
    assert a.name != b.name and f".{os.getpid()}." in a.name
    assert segments(prefix) == sorted([a.name, b.name]), "two stores of one process must not collide"
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    assert os.path.getsize(a.path) == 13 * GEOMETRY.slot_bytes == a.bytes_resident
    a.write([12, 0], random_pages(2, 1))
    assert torch.equal(a.read([0, 12]), random_pages(2, 1).flip(0))
    a.close()
    a.close()  # idempotent
    assert segments(prefix) == [b.name]
    with pytest.raises(RuntimeError, match="closed"):
        a.read([0])
    b.close()
    assert segments(prefix) == []


def _attach_and_swap(spec, queue) -> None:
    """Child: read slots 0..5, write slots 6..8, report what it read."""
    arena = HostArena.attach_spec(spec)
    queue.put(arena.read(torch.arange(6)).view(torch.uint8).numpy().tobytes())
    arena.write(torch.arange(6, 9), random_pages(3, 99))
    arena.close()


def test_attach_from_another_process_sees_the_same_bytes(prefix):
    with HostArena.create(GEOMETRY, 9, prefix=prefix) as arena:
        arena.write(torch.arange(6), random_pages(6, 5))
        queue = FORK.Queue()
        child = FORK.Process(target=_attach_and_swap, args=(arena.spec(), queue))
        child.start()
        seen = queue.get(timeout=120)
        child.join(timeout=120)
        assert child.exitcode == 0
        assert seen == arena.read(torch.arange(6)).view(torch.uint8).numpy().tobytes()
        assert torch.equal(arena.read(torch.arange(6, 9)), random_pages(3, 99)), "child's writes not visible"
        assert segments(prefix) == [arena.name], "an attached process's close must not unlink"


def _own_and_wait(prefix, queue) -> None:
    store = PageStore(GEOMETRY, 4, 4, prefix=prefix)
    ids, _ = store.allocate(1)
    store.write(ids, random_pages(1, 1))
    queue.put(store.arena.name)
    signal.pause()  # until killed


def test_killed_owner_segment_is_removed_by_the_next_store(prefix):
    queue = FORK.Queue()
    owner = FORK.Process(target=_own_and_wait, args=(prefix, queue))
    owner.start()
    stale = queue.get(timeout=120)
    assert segments(prefix) == [stale]
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(timeout=60)
    assert segments(prefix) == [stale], "SIGKILL runs no cleanup: the segment must still be there"
    fresh = PageStore(GEOMETRY, 4, 4, prefix=prefix)
    assert segments(prefix) == [fresh.arena.name], "the crash restart left the dead owner's segment"
    second = PageStore(GEOMETRY, 4, 4, prefix=prefix)  # a second store on the machine: no collision
    assert segments(prefix) == sorted([fresh.arena.name, second.arena.name])
    fresh.close()
    second.close()
    assert segments(prefix) == []


def _own_and_exit(prefix, queue) -> None:
    arena = HostArena.create(GEOMETRY, 4, prefix=prefix)
    queue.put(arena.name)
    # no close(): the interpreter-exit finalizer must remove the segment


def test_segment_removed_at_interpreter_exit(prefix):
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=_own_and_exit, args=(prefix, queue))
    child.start()
    name = queue.get(timeout=120)
    child.join(timeout=120)
    assert child.exitcode == 0 and name.startswith(prefix)
    assert segments(prefix) == []


def test_stale_scan_spares_live_owners_and_foreign_names(prefix):
    live = HostArena.create(GEOMETRY, 2, prefix=prefix)
    dead = FORK.Process(target=os.getpid)
    dead.start()
    dead.join()
    ns = live.name.split(".")[1]
    names = [f"{prefix}.{ns}.{dead.pid}.{'0' * 16}", f"{prefix}.999.{dead.pid}.{'1' * 16}", f"{prefix}.junk"]
    for n in names:
        open(os.path.join(DEFAULT_SHM_DIR, n), "w").close()
    assert remove_stale_segments(prefix) == [names[0]]
    assert segments(prefix) == sorted([live.name, names[1], names[2]])
    live.close()


def test_attach_errors_name_the_problem(prefix):
    with HostArena.create(GEOMETRY, 5, prefix=prefix) as arena:
        with pytest.raises(ValueError, match=r"has 20480 bytes, expected 24576 \(6 slots"):
            HostArena.attach(arena.name, GEOMETRY, 6)
        with pytest.raises(FileNotFoundError, match="no shared-memory arena named"):
            HostArena.attach(arena.name + "x", GEOMETRY, 5)
        with pytest.raises(ValueError, match="bare segment name"):
            HostArena.attach("../etc/passwd", GEOMETRY, 5)
    with pytest.raises(ValueError, match=r"prefix \('a.b'\)"):
        HostArena.create(GEOMETRY, 2, prefix="a.b")


def _close_inherited(arena) -> None:
    arena.close()  # the inherited owner handle: must not unlink the parent's segment


def test_forked_child_does_not_unlink_its_parents_segment(prefix):
    with HostArena.create(GEOMETRY, 3, prefix=prefix) as arena:
        child = FORK.Process(target=_close_inherited, args=(arena,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert segments(prefix) == [arena.name]


def test_failed_cuda_registration_raises(prefix, monkeypatch):
    """A nonzero cudaHostRegister return is an error, never a silent fallback (fake runtime here)."""

    class FakeRuntime:
        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 (CUDA's name)
            assert flags == 2, "must register as mapped (cudaHostRegisterMapped)"
            return 712  # cudaErrorHostMemoryAlreadyRegistered

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime())
    with HostArena.create(GEOMETRY, 2, prefix=prefix) as arena:
        with pytest.raises(
            RuntimeError, match=r"cudaHostRegister\(arena .*, 8192 bytes, mapped\) returned 712"
        ):
            arena.register_cuda()
        assert not arena.is_registered
        with pytest.raises(RuntimeError, match="not registered"):
            arena.uva_pool()
