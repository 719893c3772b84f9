"""Sizes on the command line ("16GiB", "128K") and what this machine has room for.

Byte sizes take the binary units B, KiB, MiB, GiB, TiB (a bare number is bytes); token counts
take K and M as powers of two (32K = 32,768 tokens, 1M = 1,048,576), as context lengths are
quoted. `MachineLimits` holds the room a run may use for KV on each tier; `measure_limits` reads
it from the machine (free device memory after the model is loaded, available host memory and
the shared-memory file system where host arenas live, free disk under the NVMe directory), each
scaled by a safety share, unless a flag names it.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass

from lockserve.configs.units import quantity, token_count

GIB = 1 << 30
_BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
SAFETY_SHARE = 0.9  # of measured free memory / disk: allocator slack, graphs, activations, other users
SHM_DIR = "/dev/shm"


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; '0.5MiB' -> 524288. Refuses 0 and unknown units (argparse type)."""
    try:
        value = int(quantity(text, _BYTE_UNITS, "size", "B, KiB, MiB, GiB or TiB"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size ({text!r}) must be > 0 bytes")
    return value


def parse_tokens(text: str) -> int:
    """'128K' -> 131072; '1M' -> 1048576; '512' -> 512 (configs/units.py's grammar, the config's).
    At least 2 tokens (argparse type)."""
    try:
        value = token_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"token count ({text!r}) must be a whole number >= 2")
    return value


def fmt_bytes(n: float | None) -> str:
    """1.5 GiB, 300 MiB, 12 KiB: the largest binary unit that keeps the value >= 1."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_tokens(n: int | None) -> str:
    """131072 -> 128K, 1048576 -> 1M, 1000 -> 1,000: powers-of-two multiples as K/M."""
    if n is None:
        return "-"
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


@dataclass(frozen=True)
class MachineLimits:
    """Bytes a run may use for KV per place: device memory (beside the loaded weights), host
    memory (host arenas live in shared memory), NVMe space; each with where it came from."""

    device: int
    host: int
    nvme: int
    source: dict[str, str]

    def as_dict(self) -> dict:
        return {"device_bytes": self.device, "host_bytes": self.host, "nvme_bytes": self.nvme,
                "source": self.source}


def measure_limits(device, nvme_dir: str, device_bytes: int | None = None,
                   host_bytes: int | None = None, nvme_bytes: int | None = None) -> MachineLimits:
    """What this machine has room for now (call after loading the model); a given value wins."""
    import torch

    source = {}
    if device_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            device_bytes, source["device"] = int(free * SAFETY_SHARE), "free device memory x 0.9"
        else:
            device_bytes, source["device"] = _available_host(), "available host memory x 0.9 (CPU device)"
    else:
        source["device"] = "flag"
    if host_bytes is None:
        host_bytes, source["host"] = _available_host(), "min(available memory, free /dev/shm) x 0.9"
    else:
        source["host"] = "flag"
    if nvme_bytes is None:
        os.makedirs(nvme_dir, exist_ok=True)
        nvme_bytes = int(shutil.disk_usage(nvme_dir).free * SAFETY_SHARE)
        source["nvme"] = f"free disk under {nvme_dir} x 0.9"
    else:
        source["nvme"] = "flag"
    return MachineLimits(device_bytes, host_bytes, nvme_bytes, source)


def _available_host() -> int:
    available = _meminfo_available()
    if os.path.isdir(SHM_DIR):
        available = min(available, shutil.disk_usage(SHM_DIR).free)
    return int(available * SAFETY_SHARE)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def disk_usage_bytes(directory: str | None) -> int:
    """Bytes the files under a directory occupy on disk (allocated blocks: sparse files count only
    what was written)."""
    if not directory or not os.path.isdir(directory):
        return 0
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total
