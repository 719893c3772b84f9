"""The flags the measurement commands share, each declared here once: its name, type and help.

    flags.model(p, "llama-3.1-8b")          # --model: what each command measures by default
    flags.prefill_chunk(p, 8192, "...")     # --prefill-chunk: its default and why that one

A command whose default differs from another's passes its own and says why in the help (the bench
prefill's 8,192 is the measured chunk, the capacity run's 512 sizes its write pool); the help
always ends with the default, so `--help` never disagrees with the code.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NVME_DIR = "/tmp/lockserve-bench-nvme"  # spill files of the benches (the capacity run uses its own)


def model(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--model", default=default,
                   help="a random-weight preset (llama-3.1-8b, glm-4-9b-chat-1m, tiny, ...), 'default' (the "
                        f"embedded SmolLM2), a .gguf file or HF folder (default {default})")


def modes(p: argparse.ArgumentParser, default: list[str] | tuple[str, ...]) -> None:
    p.add_argument("--modes", nargs="+", default=list(default), metavar="MODE",
                   help=f"attention:tier; tier host-nocache: host without the hot cache, host+nvme-inline: "
                        f"host+nvme with its spills inline, host+nvme-twice: host+nvme whose cached pages "
                        f"spill with a write beside their prefix records, host+nvme-nowait: host+nvme whose "
                        f"allocations spill around queued prefix saves, not waiting for them "
                        f"(default: {' '.join(default)})")


def device(p: argparse.ArgumentParser) -> None:
    """--device; args.device is never "auto" (the parse resolves it)."""
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (cuda where there is one, else cpu), cpu, cuda or cuda:N (default auto)")


def device_name(text: str) -> str:
    """ "auto" -> "cuda" where torch sees a GPU, else "cpu"; any other name as given."""
    if text != "auto":
        return text
    import torch  # here, not at the top: building the parsers imports nothing heavy

    return "cuda" if torch.cuda.is_available() else "cpu"


def nvme_dir(p: argparse.ArgumentParser, default: str = NVME_DIR) -> None:
    p.add_argument("--nvme-dir", default=default,
                   help=f"host+nvme spill files go under it (default {default})")


def prefill_chunk(p: argparse.ArgumentParser, default: int, why: str) -> None:
    """why: what the default is chosen for, in a few words."""
    p.add_argument("--prefill-chunk", type=int, default=default,
                   help=f"prompt tokens per prefill step ({why}; default {default})")


def graphs(p: argparse.ArgumentParser, default: str = "on", what: str = "decode steps") -> None:
    p.add_argument("--graphs", choices=("on", "off"), default=default,
                   help=f"replay {what} from CUDA graphs (default {default})")


def fill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fill", choices=("auto", "prompt", "synthetic"), default="auto",
                   help="auto: synthetic for random-weight presets, the passkey prompt otherwise "
                        "(default auto)")


def hot_cache_pages(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hot-cache-pages", type=int, default=None,
                   help="hot-page cache (default: 2x what one step selects over all layers, the working set)")


def host_gib(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-gib", type=float, default=None,
                   help="host arena of host+nvme (default: half the KV)")


def steps(p: argparse.ArgumentParser, default: int, warmup: int) -> None:
    """--steps (timed decode steps) and --warmup (steps before timing, graph captures)."""
    p.add_argument("--steps", type=int, default=default, help=f"timed decode steps (default {default})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"decode steps before timing, graph captures (default {warmup})")


def budget_tokens(p: argparse.ArgumentParser, default: int = 2048) -> None:
    p.add_argument("--budget-tokens", type=int, default=default,
                   help=f"LOCKS budget, tokens per KV head per step (default {default})")


def out(p: argparse.ArgumentParser, what: str) -> None:
    """what: where the command writes (a folder for NAME.*, or the result file itself)."""
    p.add_argument("--out", type=Path, required=True, help=what)


def name(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--name", default=default, help=f"file name stem (default {default})")


def summary_eigh(p: argparse.ArgumentParser) -> None:
    from lockserve.configs.schema import SUMMARY_EIGH  # the config's names (pydantic: light)

    p.add_argument("--summary-eigh", choices=SUMMARY_EIGH, default="auto",
                   help="the summary build's eigensolver on CUDA: torch (torch.linalg.eigh, waits for the "
                        "device), jacobi (a Triton kernel, no host wait) or auto (jacobi; it beat "
                        "torch on a prefill chunk's build) (cache.summary_eigh; default auto)")
