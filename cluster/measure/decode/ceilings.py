"""The bytes a decode step reads and the ceilings it is measured against (read, copy and UVA-gather
bandwidth, measured in the same run)."""

from __future__ import annotations

import math

import torch
from lockserve.kernels.timing import median_ms
from lockserve.workers.engine import Engine


def step_bytes(engine: Engine, context: int, batch: int, pcie_bytes: float) -> dict:
    """Bytes one decode step reads from HBM (a count from the shapes) and moves over PCIe."""
    model, kv, cc = engine.model, engine.kv, engine.cache_config
    lay = kv.layout
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head is not None:  # the embedding is read row by row, the LM head whole
        params -= embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    pages = math.ceil(context / lay.page_size)
    attended = pages if cc.attention == "dense" else min(pages, engine.budget_pages)
    per_page = lay.num_layers * lay.num_kv_heads * lay.geometry.slot_bytes
    summaries = 0 if cc.attention == "dense" else batch * (pages - 1) * lay.num_layers * \
        lay.num_kv_heads * kv.summaries.bytes_per_page
    kv_bytes = batch * attended * per_page
    return {"weights": params, "summaries": summaries, "kv": kv_bytes, "hbm": params + summaries + kv_bytes,
            "pcie": pcie_bytes}


def measure_ceilings(device: torch.device) -> dict:
    """Read bandwidth of a read-only kernel (a sum over 4 GiB), the device copy, and the UVA gather
    of random 8 KiB pages from 2 GiB of registered host memory, in GB/s."""
    if device.type != "cuda":
        return {"read_gbps": None, "copy_gbps": None, "gather_gbps": None}
    from lockserve.offload.arena import PageGeometry
    from lockserve.offload.gather import gather_pages
    from lockserve.offload.host import HostArena

    read, copy = _hbm_rates(device)
    geo = PageGeometry(16, 128, torch.bfloat16)
    with HostArena.create(geo, 2**31 // geo.slot_bytes) as arena:
        arena.register_cuda()
        n = 16384
        src = torch.randint(0, arena.num_slots, (n,), device=device)
        dst = torch.empty((n, *geo.page_shape), dtype=geo.dtype, device=device)
        idx = torch.arange(n, device=device)
        ms = median_ms(lambda: gather_pages(arena.uva_pool(), src, dst, idx), device, warmup=50, rep=200)
        gather = n * geo.slot_bytes / ms / 1e6
    return {"read_gbps": read, "copy_gbps": copy, "gather_gbps": gather}


def _hbm_rates(device: torch.device) -> tuple[float, float]:
    """(read, copy) GB/s: a float32-accumulating sum over 4 GiB of bf16, and a 4 GiB copy (read +
    written bytes)."""
    x = torch.randn(2**31, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    read = 4 * 2**30 / median_ms(lambda: x.sum(dtype=torch.float32), device, warmup=50, rep=200) / 1e6
    return read, 8 * 2**30 / median_ms(lambda: y.copy_(x), device, warmup=50, rep=200) / 1e6
