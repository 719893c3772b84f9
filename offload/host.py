"""The `host` tier: the arena in POSIX shared memory, owned by the node's page store.

The owner (`HostArena.create`) makes a segment in the shared-memory directory,
named `<prefix>.<pidns>.<pid>.<token>`: the owner's pid namespace and pid make
a dead owner's segments recognisable (`remove_stale_segments`, run on every
create: the "crash restart"), the random token keeps two stores of one process
apart. The GPU worker maps it by name (`HostArena.attach`) and registers the
mapping with CUDA (`register_cuda`) so Triton kernels read it zero-copy (UVA).
Segments are created with mode 0600 and removed on close, at interpreter exit
(a weakref finalizer), or by the next store after a crash.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass

import torch

from .arena import PageGeometry
from .gather import HostPool
from .pool import PoolTier

# POSIX shared memory on Linux is the tmpfs mounted here (what shm_open uses).
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "lockserve-arena"
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped


def _pid_namespace() -> str:
    """An id of this process's pid namespace: pids are only comparable inside one."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def segment_name(prefix: str, pid: int | None = None) -> str:
    """A fresh segment name for an owner pid (default: this process)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", prefix):
        raise ValueError(f"prefix ({prefix!r}) must be letters, digits, '_' or '-'")
    return f"{prefix}.{_pid_namespace()}.{os.getpid() if pid is None else pid}.{secrets.token_hex(8)}"


def _owner_pid(name: str, prefix: str) -> int | None:
    """The owner pid encoded in a segment name of this pid namespace, else None."""
    m = re.fullmatch(rf"{re.escape(prefix)}\.(\d+)\.(\d+)\.[0-9a-f]{{16}}", name)
    if m is None or m.group(1) != _pid_namespace():
        return None
    return int(m.group(2))


def pid_alive(pid: int) -> bool:
    """True if pid names a live process (a zombie counts as dead: it holds no mapping)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_segments(prefix: str = DEFAULT_PREFIX, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove segments whose owner pid (same pid namespace) is dead; return their names.

    NOTE: a reused pid makes a dead owner look alive; its segment then waits for
    the next start after that pid exits. Segments of other namespaces are left alone.
    """
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        pid = _owner_pid(name, prefix)
        if pid is None or pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass  # another store removed it first
    return removed


@dataclass(frozen=True)
class HostArenaSpec:
    """What another process needs to attach an arena (plain data, picklable)."""

    name: str
    num_slots: int
    geometry: dict
    shm_dir: str = DEFAULT_SHM_DIR


def _release(state: dict) -> None:
    """Unregister from CUDA and (owner only) unlink the segment. Safe to run twice.

    The mapping itself is unmapped when the last tensor viewing it is freed: closing
    it here would leave live views dangling. A forked child inherits this finalizer
    but not the ownership: only the process that made the state acts on it.
    """
    if state["pid"] != os.getpid():
        return
    ptr = state.pop("registered_ptr", None)
    if ptr is not None:
        rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        state["unregister_rc"] = int(getattr(rc, "value", rc))
    if state.pop("owner", False):
        try:
            os.unlink(state["path"])
        except FileNotFoundError:
            pass


class HostArena(PoolTier):
    """Pool `[num_slots, 2, B, d]` in a shared-memory segment. Use `create` or `attach`."""

    def __init__(self, geometry: PageGeometry, path: str, mm: mmap.mmap, num_slots: int, owner: bool):
        pool = torch.frombuffer(mm, dtype=torch.uint8).view(geometry.dtype)
        super().__init__(geometry, pool.view(num_slots, *geometry.page_shape))
        self.path = path
        self.owner = owner
        self._state = {"path": path, "owner": owner, "pid": os.getpid()}
        self._finalizer = weakref.finalize(self, _release, self._state)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def shm_dir(self) -> str:
        return os.path.dirname(self.path)

    def spec(self) -> HostArenaSpec:
        return HostArenaSpec(self.name, self.num_slots, self.geometry.to_dict(), self.shm_dir)

    @classmethod
    def create(
        cls,
        geometry: PageGeometry,
        num_slots: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        shm_dir: str = DEFAULT_SHM_DIR,
    ) -> HostArena:
        """Make a new segment (mode 0600) after removing stale ones of dead owners.

        The segment's memory is reserved up front (posix_fallocate) so a full tmpfs
        fails here with a clear error instead of a SIGBUS on first touch.
        """
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be > 0")
        remove_stale_segments(prefix, shm_dir)
        path = os.path.join(shm_dir, segment_name(prefix))
        nbytes = num_slots * geometry.slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # independent of the umask
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise OSError(e.errno, f"cannot create a {nbytes}-byte arena in {shm_dir}: {e.strerror}") from e
        os.close(fd)
        return cls(geometry, path, mm, num_slots, owner=True)

    @classmethod
    def attach(
        cls, name: str, geometry: PageGeometry, num_slots: int, *, shm_dir: str = DEFAULT_SHM_DIR
    ) -> HostArena:
        """Map an existing segment by name; its size must match num_slots * slot_bytes."""
        if "/" in name or not name:
            raise ValueError(f"name ({name!r}) must be a bare segment name")
        path = os.path.join(shm_dir, name)
        nbytes = num_slots * geometry.slot_bytes
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory arena named {name!r} in {shm_dir}") from None
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(
                    f"arena {name!r} has {size} bytes, expected {nbytes} ({num_slots} slots of {geometry})"
                )
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(geometry, path, mm, num_slots, owner=False)

    @classmethod
    def attach_spec(cls, spec: HostArenaSpec) -> HostArena:
        return cls.attach(
            spec.name, PageGeometry.from_dict(spec.geometry), spec.num_slots, shm_dir=spec.shm_dir
        )

    @property
    def is_registered(self) -> bool:
        return self._state.get("registered_ptr") is not None

    def register_cuda(self) -> None:
        """Register the mapping with CUDA (mapped), so device kernels read it via UVA.

        Raises RuntimeError on a nonzero CUDA return code: there is no silent fallback.
        """
        if self.is_registered:
            return
        ptr, nbytes = self.pool.data_ptr(), self.bytes_resident
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_MAPPED)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            raise RuntimeError(
                f"cudaHostRegister(arena {self.name!r}, {nbytes} bytes, mapped) returned {code}"
            )
        self._state["registered_ptr"] = ptr

    def uva_pool(self) -> HostPool:
        """The pool as a pointer object the Triton gather accepts (needs `register_cuda` first)."""
        if not self.is_registered:
            raise RuntimeError(f"arena {self.name!r} is not registered with CUDA; call register_cuda()")
        return HostPool(self.pool.data_ptr(), tuple(self.pool.shape), self.geometry.dtype)

    def close(self) -> None:
        """Unregister, unlink (owner), drop this handle's view. Idempotent.

        The caller makes sure no device kernel still reads the arena (synchronize first).
        """
        self._finalizer()
        self._pool = None
        rc = self._state.pop("unregister_rc", 0)
        if rc != 0:
            raise RuntimeError(f"cudaHostUnregister(arena {self.name!r}) returned {rc}")
