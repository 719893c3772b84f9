"""The capacity experiment's accounting: how an HBM budget is spent per mode (ACCOUNTING, quoted
in `lockserve experiment capacity --help` and in every summary it writes) and the loads it admits.
Plain text and names, so building the parsers imports nothing heavy."""

LOADS = ("longest", "concurrent")

ACCOUNTING = """\
How the budget is spent (per mode, per HBM budget H; a page id = 16 tokens of one sequence,
K and V of every layer and KV head):
- hbm modes keep everything on the GPU: the page arena, the LOCKS summaries (allocated by
  dense:hbm too) and the engine's other KV tensors must fit in H.
- host tiers keep full pages off the GPU: in host memory (host), or on NVMe below a host arena of
  --nvme-host-share of the KV (host+nvme; more where NVMe lacks room). The GPU keeps the
  summaries of every page, the hot-page cache (--hot-cache-share of H, at least one layer's
  selection of the batch; none on locks:host-nocache), the staging rows and the write pool: these
  must fit in H. The pages must fit in host memory (host) or in host memory and NVMe space
  together (host+nvme: a page is in one of them, a promotion frees its NVMe slot).
- Device bytes are measured, not computed: two probe engines (16 and 1,040 page ids) give the
  fixed part and the part per page id (torch.cuda.memory_allocated around the engine's
  construction; on CPU the bytes of its KV tensors); the engine is sized 1/1024 of H below
  that line (allocator rounding), measured again and must fit H (one that does not is rebuilt
  smaller by its overshoot: shrunk_from in the JSON). The peak during the decode (CUDA graphs, workspace and
  activations on top) is recorded beside it, not charged to H.
- Admitted is the engine's own admission: the longest context is the largest prompt that
  Engine.check_request accepts with max_tokens = warmup + steps + 8 (its refusal of one token
  more is recorded); the most requests is how many requests of --context tokens the scheduler
  admits together (Engine.fill_synthetic, one by one, until it refuses one), at most --max-batch.
- Sustained TPOT and throughput come from decoding that load. By default (--fill synthetic) the
  contexts are filled with random K/V and real summaries (no prefill: it would take longer than
  the decode), so bytes and times are honest and page reuse is not. --fill prompt prefills the
  passkey prompt instead, the longest load only: a real model's page reuse.
"""
