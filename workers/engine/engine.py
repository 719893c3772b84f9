"""The decode engine: requests in, one continuous-batching step at a time, tokens out.

    engine = Engine(model, tokenizer, CacheConfig(...), SchedulerConfig(...), device)
    engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...          # StepOutput: new token ids, text delta, finished

A step: the scheduler admits what fits and plans the batch; the KV manager places the step's
pages; the model runner runs the forward with `PagedAttention` as its attention (on CUDA the
decode rows replay a CUDA graph, and prefill chunks beside them run in an eager forward of their
own; see runner.py); pages that filled are committed (tier +
summaries); each sequence that reached its end samples a token (one host transfer of the ids).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.kernels import LocksConfig
from lockserve.offload.host import HostArenaSpec
from tqdm import tqdm

from .admission import EngineLimits, locks_budget_pages
from .attention import PagedAttention, window_pages
from .idle_summaries import IdleSummaries, budget_bytes
from .kv_manager import GIB, KVLayout, KVManager, SummaryTable, TierSpec, kv_pages
from .prefix_cache import PrefixCache, cache_salt
from .prefix_disk import PrefixDisk
from .request import RequestOptions
from .runner import ModelRunner
from .sampling import SamplingParams, make_generator, sample
from .scheduler import Batch, PageIdAllocator, Scheduler
from .selectors import make_selector
from .sequence import Sequence, SequenceStatus, StepOutput

log = logging.getLogger(__name__)

WARM_UP_ID = "lockserve-warm-up"  # Engine.warm_up's request (its own: no user request is queued yet)
FILL_BAR_MIN_TOKENS = 1 << 16  # show_progress: synthetic fills shorter than this take no bar


@dataclass(frozen=True)
class PrefilledKV:
    """A prompt's KV right after its prefill and the token that prefill sampled (Engine.export_prefill):
    what Engine.fill_prefilled needs to stand in for the prefill in another engine of the same model.
    pages: [L, ceil(len(prompt_ids) / B), Hkv, 2, B, d] in the KV dtype."""

    prompt_ids: tuple[int, ...]
    first_token: int
    pages: torch.Tensor


class Engine:
    """One model on one device with its paged KV cache (see the module docstring).

    max_pages: page ids of KV capacity (a page id = page_size tokens of one sequence, all layers
    and heads); None derives it from the config (host_capacity_gib on hbm/host,
    host_capacity_gib + nvme_capacity_gib on host+nvme: `kv_pages`). max_model_len: cap on
    prompt + max_tokens (None = the model's positions). seed: seeds the generators of requests
    without a seed. show_progress: a tqdm bar while a long prompt prefills or a long synthetic fill
    runs. kernels: "auto" (Triton on CUDA, the torch reference on CPU), "ops" or "reference" (see
    attention.KERNEL_CHOICES). host_arena: on tier host, attach this arena (from the node's
    PageStore; it must hold exactly the layout's slots) instead of creating one. use_graphs:
    replay decode steps from CUDA graphs (None: on CUDA, with a capturable page selector), and
    with them the summary builds of the pages a decode step fills.
    """

    def __init__(self, model, tokenizer, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, device: torch.device | str | None = None,
                 *, max_pages: int | None = None, max_model_len: int | None = None, seed: int = 0,
                 show_progress: bool = False, kernels: str = "auto",
                 host_arena: HostArenaSpec | None = None, use_graphs: bool | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        # Normalised ("cuda" -> "cuda:0"): device checks compare tensor.device with this.
        self.device = torch.empty(0, device=device if device is not None else model.device).device
        cc, sc, mc = self.cache_config, self.scheduler_config, model.config
        self.max_model_len = min(mc.max_position_embeddings, max_model_len or mc.max_position_embeddings)
        if host_arena is not None and cc.tier != "host":
            raise ValueError(f"host_arena is only for tier 'host', not {cc.tier!r}")
        self._host_arena = host_arena
        self.locks = LocksConfig(page_size=cc.page_size, rank=cc.rank, basis_bits=cc.basis_bits,
                                 eigh=cc.summary_eigh)
        budget = locks_budget_pages(cc.budget_tokens, cc.page_size, cc.sink_pages, cc.recent_pages)
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cc.page_size, model.dtype,
                          max_pages or kv_pages(mc, cc, sc.max_num_seqs, self.max_model_len, model.dtype))
        self.limits = EngineLimits(mc.vocab_size, self.max_model_len, cc.page_size, layout.max_pages, cc.tier,
                                   cc.attention, cc.budget_tokens, budget, cc.sink_pages, cc.recent_pages)
        # Write-pool pages: open pages of all running sequences + every page one step can touch.
        tail_pages = 2 * sc.max_num_seqs + math.ceil(sc.max_num_batched_tokens / cc.page_size) + 1
        # The page selector (cache.attention) owns the per-page tables the KV manager fills at commit;
        # LOCKS with the share-average is scored by PagedAttention itself (the decode hot path).
        self.selector = make_selector(cc, layout, self.device, self._pages_per_seq)
        # Host tiers: prefilling requests' settled pages kept in the write pool (prefill_window_tokens).
        window_tokens = 0 if cc.tier == "hbm" else min(cc.prefill_window_tokens, self.max_model_len)
        window = math.ceil(window_tokens / cc.page_size)
        self.kv = KVManager(layout, self.locks, self._tier_spec(layout), self.device, tail_pages,
                            summaries=self.selector.table, window_pages=window)
        self.recovered_pages = self._release_recovered_pages()
        self.attention = PagedAttention(self.kv, cc.sink_pages, cc.recent_pages, kernels,
                                        selector=None if self.selector.builtin else self.selector,
                                        radix_bits=cc.select_radix_bits)
        scored = cc.attention != "dense"
        blocker = self.selector.graph_blocker if scored else None
        self.runner = ModelRunner(model, self.kv, self.attention, sc.max_num_seqs, self._pages_per_seq,
                                  scored, use_graphs, graph_blocker=blocker)
        if blocker and self.device.type == "cuda" and use_graphs is None:
            log.info("decode steps run eagerly (no CUDA graphs): %s", blocker)
        # (said only where it was asked for: the default is for GPUs, and a CPU engine runs without it)
        if (sc.prefill_layers_decoding is not None and "prefill_layers_decoding" in sc.model_fields_set
                and not self.runner.pad_decode):
            log.warning("scheduler.prefill_layers_decoding (%d) has no effect here: a prompt's chunks run in "
                        "one forward with the decode rows (%s)", sc.prefill_layers_decoding,
                        self.runner.eager_reason)
        if self.runner.use_graphs and type(self.kv.summaries) is SummaryTable:
            self.kv.capture_settles(sc.max_num_seqs)  # a decode step fills at most a page a sequence
        # Prefix reuse with LOCKS's own per-page summaries (a per-sequence selector's tables are not
        # a page's own: shared_sequence fits one basis per sequence).
        self.prefix = PrefixCache(self._salt(), cc.page_size) if cc.prefix_reuse and self.selector.builtin \
            else None
        # host+nvme: cached pages also persisted in nvme_dir, found again by a restarted engine.
        persist = self.prefix is not None and cc.tier == "host+nvme" and cc.prefix_nvme_gib > 0
        self.prefix_disk = PrefixDisk(self.kv, cc.nvme_dir, self._salt(), int(cc.prefix_nvme_gib * GIB),
                                      save_job_bytes=int(cc.prefix_save_mib * (1 << 20)),
                                      saved_spills=cc.nvme_saved_spills,
                                      wait_for_saves=cc.waits_for_saves) if persist else None
        # Idle cached pages' summaries in the device table up to cache.idle_summary_gib (None: all
        # stay; moving them out frees no device memory yet, see idle_summaries.py).
        on = self.prefix is not None and cc.idle_summary_gib is not None
        self.idle = IdleSummaries(self.kv.summaries, self.prefix, budget_bytes(cc.idle_summary_gib),
                                  self.device) if on else None
        self.scheduler = Scheduler(PageIdAllocator(layout.max_pages), cc.page_size, sc.max_num_seqs,
                                   sc.max_num_batched_tokens, sc.prefill_chunk, prefix=self.prefix,
                                   on_evict=self._evicted,
                                   prefill_chunk_decoding=sc.prefill_chunk_decoding, disk=self.prefix_disk,
                                   on_reuse=self.idle.bring_back if self.idle is not None else None,
                                   prefill_attention_decoding=sc.prefill_attention_decoding)
        self.show_progress = show_progress
        self._rng = torch.Generator().manual_seed(seed)
        self._live: dict[str, Sequence] = {}
        self._bars: dict[str, tqdm] = {}
        self._counters = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0}

    @property
    def budget_pages(self) -> int:
        """The engine's LOCKS budget (cache budget_tokens) in pages."""
        return self.limits.budget_pages

    # ---- construction helpers -----------------------------------------------------------------

    def _salt(self) -> bytes:
        """What makes one engine's pages and summaries another's: the model's config, the KV dtype
        and page size, the summary's rank and bits, the attention mode and group rule."""
        cc = self.cache_config
        return cache_salt(model=self.model.config, dtype=self.model.dtype, page_size=cc.page_size,
                          rank=cc.rank, basis_bits=cc.basis_bits, attention=cc.attention,
                          group_rule=cc.group_rule)

    def _evicted(self, pids: list[int]) -> None:
        """Cached pages the scheduler evicts: the tier drops their state, the host their summaries.
        A page with a queued save to the prefix store is freed only once the writer has read it."""
        if self.prefix_disk is not None:
            self.prefix_disk.wait_for(pids)
        self.kv.release_pages(pids)
        if self.idle is not None:
            self.idle.forget(pids)

    @property
    def _pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.cache_config.page_size)

    def _tier_spec(self, layout: KVLayout) -> TierSpec:
        cc, sc = self.cache_config, self.scheduler_config
        if cc.tier == "hbm":
            return TierSpec("hbm")
        # dense reads every page every step: through no cache (it would thrash), straight from host.
        slots = cc.hot_cache_slots(self.device.type == "cuda")
        direct = cc.attention == "dense" or not slots
        per_row = self._pages_per_seq if cc.attention == "dense" else self.budget_pages
        per_row = max(per_row, window_pages(self.model.config.layer_windows, cc.page_size))
        max_selected = sc.max_num_seqs * layout.num_kv_heads * min(per_row, self._pages_per_seq)
        cache = None if direct else slots
        if cache is not None and cache < max_selected:
            raise ValueError(
                f"hot_cache_pages ({slots}) must be >= max_num_seqs ({sc.max_num_seqs}) "
                f"x KV heads ({layout.num_kv_heads}) x budget pages ({self.budget_pages}) = {max_selected}")
        host_pages = nvme_pages = None
        if cc.tier == "host+nvme":
            host_pages, nvme_pages = self._spill_slots(layout)
        return TierSpec(cc.tier, cache_pages=cache, max_selected=max_selected, host_pages=host_pages,
                        nvme_pages=nvme_pages, nvme_dir=cc.nvme_dir, arena=self._host_arena,
                        lookahead=cc.nvme_lookahead, io_threads=cc.nvme_io_threads,
                        spill_behind=cc.nvme_spill_behind,
                        cache_commit=cc.hot_cache_commit,
                        # the engine frees every page an earlier engine left (_release_recovered_pages):
                        # reading them first to check their checksums took 28.4 s at 128K (8B, H100)
                        verify_on_open=False)

    def _spill_slots(self, layout: KVLayout) -> tuple[int, int]:
        """(host arena slots, NVMe slots) of tier host+nvme: a page is in one of them, so together
        they must hold every page of max_pages ids."""
        cc, slot = self.cache_config, layout.geometry.slot_bytes
        host, nvme = int(cc.host_capacity_gib * GIB) // slot, int(cc.nvme_capacity_gib * GIB) // slot
        if host <= 0:
            raise ValueError(f"host_capacity_gib ({cc.host_capacity_gib}) holds no page of {slot} bytes")
        if host + nvme < layout.num_slots:
            need = layout.num_slots * slot / GIB
            raise ValueError(f"max_pages ({layout.max_pages}) needs {need:.3g} GiB of KV, more than "
                             f"host_capacity_gib ({cc.host_capacity_gib:g}) + nvme_capacity_gib "
                             f"({cc.nvme_capacity_gib:g})")
        return host, max(1, min(nvme, layout.num_slots))  # more NVMe slots than pages go unused

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    options: RequestOptions | None = None) -> None:
        """Queue a request. Raises ValueError naming the field for bad input (the engine state is
        unchanged then): empty or out-of-vocabulary prompt, prompt + max_tokens beyond the model's
        positions or the KV capacity, invalid sampling values, a budget or tier the engine cannot
        serve, a request_id already in use."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id ({request_id!r}) must be a non-empty string")
        if request_id in self._live:
            raise ValueError(f"request_id ({request_id!r}) is already in use")
        params = SamplingParams.coerce(params)
        prompt = self.limits.check_prompt_ids(prompt_ids)
        budget = self.check_request(len(prompt), params, options)
        eos = frozenset() if params.ignore_eos else self.tokenizer.stop_ids
        seq = Sequence(
            request_id=request_id, prompt_ids=prompt, params=params,
            generator=make_generator(params, self.device, self._rng),
            detokenizer=self.tokenizer.detokenizer(prompt),
            stop_ids=frozenset(params.stop_token_ids) | eos,
            budget_pages=budget,
        )
        self._live[request_id] = seq
        self.scheduler.add(seq)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams | None = None,
                      options: RequestOptions | None = None) -> int | None:
        """Raise ValueError (naming field and value) if a prompt of this many tokens with these params
        and options can never be served: prompt + max_tokens beyond the model's positions or the KV
        capacity, invalid sampling values, a budget or tier the engine cannot serve (the rules are
        `EngineLimits.check`'s). Queues nothing. Returns the request's LOCKS page budget (None =
        every page)."""
        params = SamplingParams.coerce(params)
        opts = RequestOptions.coerce(options)
        return self.limits.check(num_prompt_tokens, params.max_tokens, opts.budget_tokens, opts.attention,
                                 opts.tier)

    def fill_synthetic(self, request_id: str, seed: int = 0) -> int:
        """Benchmarks: stand in for the prefill of a queued request and its first sampled token.
        Admits the request now (it must be next in the queue and fit), writes random K/V for every
        prompt token (full pages to the tier, summarised by the real code) and appends the prompt's
        last token as the first output, so the next step decodes. Returns that token id."""
        seq = self._live.get(request_id)
        if seq is None or seq.num_computed or seq.output_ids:
            raise ValueError(f"request_id ({request_id!r}) must be a queued request that has not started")
        seq.reuse_prefix = False  # random K/V: never the model's, never shared
        self.scheduler.admit()
        if seq.status is not SequenceStatus.RUNNING:
            raise RuntimeError(f"request {request_id!r} could not be admitted now (queue order or capacity)")
        # A million tokens take minutes to fill on host+nvme: a bar, as a long prefill has.
        bar = tqdm(total=seq.num_prompt, desc=f"synthetic fill {request_id}", unit="tok", leave=False,
                   disable=not self.show_progress or seq.num_prompt < FILL_BAR_MIN_TOKENS)
        with bar:
            self.kv.fill_random(request_id, seq.pids, seq.num_prompt, seed,
                                on_pages=lambda pages: bar.update(pages * self.cache_config.page_size))
        seq.num_computed = seq.num_prompt
        out = seq.append_token(seq.prompt_ids[-1])
        if seq.finished:
            self._finish(seq)
        return out.token_ids[0]

    def export_prefill(self, request_id: str) -> PrefilledKV:
        """The KV of a request whose prefill has just finished (its first token sampled, no decode
        step yet), copied out with that token: an evaluation prefills a prompt once and decodes it in
        engines of other page selectors and budgets (`fill_prefilled`)."""
        seq = self._live.get(request_id)
        if seq is None or seq.num_computed != seq.num_prompt or len(seq.output_ids) != 1:
            raise ValueError(f"request_id ({request_id!r}) must be a live request whose prefill has just "
                             "finished (one token sampled, none decoded)")
        pages = self.kv.read_tokens(request_id, seq.pids, seq.num_prompt)
        return PrefilledKV(tuple(seq.prompt_ids), seq.output_ids[0], pages)

    def fill_prefilled(self, request_id: str, prefilled: PrefilledKV) -> StepOutput:
        """Stand in for the prefill of a queued request with `prefilled` (export_prefill of an engine
        of the same model: prefill attention is dense in every mode, so the KV and the sampled token
        are the ones this engine's own prefill computes). Admits the request now (it must be next in
        the queue and fit), writes the KV (full pages to the tier and this engine's selector tables,
        the partial page to the write pool) and appends the first token. Returns its output."""
        seq = self._live.get(request_id)
        if seq is None or seq.num_computed or seq.output_ids:
            raise ValueError(f"request_id ({request_id!r}) must be a queued request that has not started")
        if tuple(seq.prompt_ids) != prefilled.prompt_ids:
            raise ValueError(f"prefilled: its prompt ({len(prefilled.prompt_ids)} tokens) is not request "
                             f"{request_id!r}'s ({seq.num_prompt} tokens)")
        seq.reuse_prefix = False  # its pages are written whole, from another engine's KV
        self.scheduler.admit()
        if seq.status is not SequenceStatus.RUNNING:
            raise RuntimeError(f"request {request_id!r} could not be admitted now (queue order or capacity)")
        self.kv.fill_pages(request_id, seq.pids, seq.num_prompt, prefilled.pages)
        seq.num_computed = seq.num_prompt
        out = seq.append_token(prefilled.first_token)
        if seq.finished:
            self._finish(seq)
        return out

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages at once. Returns False for an unknown/finished id."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one step; returns an output for every sequence that sampled a token in it."""
        if self.prefix_disk is not None:
            self.prefix_disk.reap()  # saves the writer finished: their pages may spill again
        batch = self.scheduler.schedule()
        if not batch:
            return []
        batch = Batch(self.runner.order(batch.decodes), batch.prefills)  # decode rows in row order
        nd = len(batch.decodes)
        planned = [self.kv.plan(chunk) for chunk in batch.decodes]
        under_way = self.runner.inflight  # a pinned chunk, planned at its forward's first part
        planned += under_way.planned if under_way else [self.kv.plan(c, window=True) for c in batch.prefills]
        logits = self.runner.execute(batch, planned, self._prefill_layers(batch))  # [sampled rows, vocab]
        # NOTE: scheduler.pinned and runner.inflight are set and cleared together (here, and when the
        # chunk's sequence finishes: Scheduler.finish, ModelRunner.release)
        self.scheduler.pinned = batch.prefills[0] if self.runner.inflight is not None else None
        if self.runner.inflight is not None:  # the chunks' forward goes on next step: nothing of them ends
            batch, planned = Batch(batch.decodes, []), planned[:nd]
        self.kv.commit(list(zip(batch.chunks, planned, strict=True)))
        self._counters["steps"] += 1
        return self._sample(batch, logits)

    def _prefill_layers(self, batch: Batch) -> int | None:
        """Layers of this step's prefill forward to run (None: all that are left): a few a step
        (scheduler.prefill_layers_decoding) where one chunk prefills beside decoding requests whose
        rows run apart from it (runner.pad_decode: CUDA graphs)."""
        layers = self.scheduler_config.prefill_layers_decoding
        if layers is None or not batch.decodes or len(batch.prefills) != 1 or not self.runner.pad_decode:
            return None
        return layers

    def _sample(self, batch: Batch, logits: torch.Tensor | None) -> list[StepOutput]:
        # logits: one row per chunk that samples, in token order (ModelRunner.execute)
        seqs = [chunk.seq for chunk in batch.chunks if chunk.sample]
        for chunk in batch.chunks:
            chunk.seq.num_computed = chunk.end
        for chunk in batch.prefills:
            self._progress(chunk)
            # The chunk's full pages are settled (committed above): other requests may reuse them now,
            # and on host+nvme their saves start while they are in host memory, not at the prompt's
            # end, when half of a long document had spilled and its saves read it back off NVMe.
            self.scheduler.share(chunk.seq, chunk.end // self.cache_config.page_size,
                                 last=chunk.end == chunk.seq.num_prompt)
        if not seqs:
            return []
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs]).tolist()
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            outputs.append(seq.append_token(token))
            self._counters["generated_tokens"] += 1
            if seq.finished:
                self._finish(seq)
        return outputs

    def _progress(self, chunk) -> None:
        seq = chunk.seq
        if not self.show_progress or seq.num_prompt < 4 * self.scheduler_config.prefill_chunk:
            return
        bar = self._bars.get(seq.request_id)
        if bar is None:
            bar = self._bars[seq.request_id] = tqdm(total=seq.num_prompt, desc=f"prefill {seq.request_id}",
                                                    unit="tok", leave=False)
        bar.update(min(chunk.end, seq.num_prompt) - bar.n)
        if not seq.in_prefill:
            bar.close()
            del self._bars[seq.request_id]

    def _finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's pages, open page and cache entries at once."""
        self._counters["prompt_tokens"] += seq.num_prompt
        settled = self.scheduler.finish(seq)  # its own ids; cached pages stay with the prefix cache
        self.kv.release(seq.request_id, settled, len(settled))
        if self.idle is not None:
            if self.prefix_disk is not None:  # a deferred save reads the rows before they leave
                self.prefix_disk.take(self.idle.leaving())
            self.idle.enforce()  # its cached pages may be idle now
        self.runner.release(seq.request_id)
        self._live.pop(seq.request_id, None)
        bar = self._bars.pop(seq.request_id, None)
        if bar is not None:
            bar.close()

    # ---- introspection ------------------------------------------------------------------------

    def warm_up(self) -> float:
        """Run throwaway requests before any user's, so that the kernels compile and the first
        decode and settle graphs are captured now: a prompt of the budget's pages and two more (its
        decode scores and selects, as a long request's does), then one of two pages (its decode
        attends every page, as a short request's does; the only one where the engine attends
        densely or cannot hold the first), each decoding until a page fills. On the H200 the first served
        request otherwise waited 5 s for its first token (docs/notes/decode_step.md). The token
        counters start from zero after it; the tier's byte and hit counters keep its pages. Returns
        its seconds; 0.0 when the engine cannot admit even the short one. The prefill's kernels compile
        and plan first (PagedAttention.warm_up: the paged prefill's variants, which a warm request's
        tail met at 1.1 s; cuDNN's plans for a prefill chunk over every key block)."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs before any request: this engine has requests in flight")
        self.attention.warm_up(self.model.config.num_heads, self.model.dtype, self.max_model_len,
                               self.scheduler_config.prefill_chunk)
        page = self.cache_config.page_size
        params = SamplingParams(temperature=0.0, max_tokens=page + 2, ignore_eos=True)
        # The budget's pages and two more (decode scores and selects), then two pages (decode
        # attends every page: the dense selection's kernel and graphs, which a user's short
        # request otherwise compiled and captured), one after the other (batch 1 each).
        pages = [2] if self.cache_config.attention == "dense" else [self.budget_pages + 2, 2]
        prompts = []
        for n in pages:
            candidate = [i % self.model.config.vocab_size for i in range(1, n * page + 1)]
            try:
                self.check_request(len(candidate), params)
            except ValueError as err:
                log.info("warm-up request of %d pages skipped: %s", n, err)
                continue
            prompts.append(candidate)
        if not prompts:
            return 0.0
        start = time.perf_counter()
        for ids in prompts:
            self.add_request(WARM_UP_ID, ids, params)
            self._live[WARM_UP_ID].reuse_prefix = False  # leaves nothing in the prefix cache
            while self.has_unfinished():
                self.step()
        self._counters.update(steps=0, prompt_tokens=0, generated_tokens=0)
        return time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        """Queue, running, KV pages used/capacity (used: by running sequences; idle cached pages are
        reclaimable and counted as prefix_idle_pages), hot-cache hit rate, bytes per tier, prefix
        reuse (syncs the device)."""
        alloc = self.scheduler.allocator
        tier = self.kv.stats()
        used = alloc.num_used - (self.prefix.num_idle if self.prefix is not None else 0)  # idle: reclaimable
        return {
            "queue_len": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "pages_used": used,
            "pages_capacity": alloc.capacity,
            "capacity_used": used / alloc.capacity,
            "tier": self.cache_config.tier,
            "attention": self.cache_config.attention,
            "hit_rate": tier.hit_rate,
            "bytes_per_tier": dict(tier.bytes_resident),
            "bytes_moved": tier.bytes_moved,
            "bytes_written": tier.bytes_written,
            "cache_hits": tier.hits,
            "cache_misses": tier.misses,
            **self._prefix_stats(),
            **self.kv.settled.counters(),
            "prefill_kept_pages": self.kv.num_kept_pages,
            "prefill_kept_pages_read": self.kv.kept_pages_read,
            **self.runner.counters,
            **self._counters,
        }

    def _prefix_stats(self) -> dict[str, Any]:
        """Prefix reuse: lookups, hits, cached and prompt tokens of admissions, pages held / idle /
        evicted, and the KV bytes the held pages take (on the engine's tier)."""
        if self.prefix is None:
            return {"prefix_reuse": False}
        s, per_id = self.prefix.stats, self.kv.layout.bytes_per_page_id
        return {"prefix_reuse": True, "prefix_queries": s.queries, "prefix_hits": s.hits,
                "prefix_cached_tokens": s.cached_tokens, "prefix_prompt_tokens": s.prompt_tokens,
                "prefix_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "prefix_pages": len(self.prefix), "prefix_idle_pages": self.prefix.num_idle,
                "prefix_bytes": len(self.prefix) * per_id, "prefix_evicted_pages": s.evicted_pages,
                **(self.idle.stats() if self.idle is not None else {}),
                **(self.prefix_disk.stats() if self.prefix_disk is not None else {})}

    def _release_recovered_pages(self) -> dict[str, int]:
        """Tier host+nvme: pages an earlier engine over this nvme_dir spilled and left there (a crash,
        or a close with cached prefixes spilled). The page store found them in its manifest (and
        did not read them: TierSpec.verify_on_open is off); no request of this engine owns them
        (persisted prefixes come back from the prefix store's own records, into new page ids), so
        they are freed here, else every restart would leak their ids. Returns {"pages", "bytes"}."""
        store = getattr(self.kv.settled, "store", None)
        if store is None or store.nvme is None:
            return {"pages": 0, "bytes": 0}
        found = store.recovered_ids()
        if found.numel():
            log.warning("freeing %d pages an earlier engine left in %s (unread: nothing owns them)",
                        found.numel(), store.nvme.directory)
            store.free(found)
        return {"pages": int(found.numel()), "bytes": int(found.numel()) * store.geometry.slot_bytes}

    def request_status(self, request_id: str) -> SequenceStatus | None:
        seq = self._live.get(request_id)
        return None if seq is None else seq.status

    def close(self) -> None:
        """Release the tier (shared memory, files). Idempotent."""
        for rid in list(self._live):
            self.abort(rid)
        if self.prefix_disk is not None:
            self.prefix_disk.close()  # waits for queued saves (PrefixDisk.close_drain_s), then drops them
        self.kv.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
