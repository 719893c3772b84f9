"""Typed serving configuration: one pydantic model per section, grouped by ``ServeConfig``.

Every field carries bounds and a one-line description. Checks that involve two
fields live in ``model_validator``s whose messages quote both values, e.g.
``max_num_batched_tokens (2048) must be >= max_num_seqs (4096)``. Unknown keys are
errors (``extra="forbid"``), so a typo in a YAML file never silently falls back
to a default. Loading from YAML and turning validation errors into one readable
message is ``configs/loader.py``'s job.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from .units import token_text

AUTO = "auto"
# A count of tokens: an int, or text such as "128K" or "8M" (configs/units.py: K and M are powers of two).
Tokens = Annotated[int, BeforeValidator(token_text)]
OptionalTokens = Annotated[int | None, BeforeValidator(token_text)]
HOT_CACHE_AUTO_PAGES = 4096  # hot_cache_pages "auto" on a GPU

# The choices shared with the engine contract (cluster/engine_client.py) and the
# HTTP extras, named once here because configs is imported by every area.
# "locks" and "dense" serve; the others are page selectors for the quality evaluation
# (`lockserve eval retrieval`; workers/engine/selectors.py says what each reads and costs).
ATTENTION_MODES: tuple[str, ...] = (
    "locks", "dense", "oracle", "quest", "centroid", "shared_sequence", "shared_global")
GROUP_RULES: tuple[str, ...] = ("share_average", "group_max", "group_mass")
BASIS_BITS: tuple[int, ...] = (16, 8, 4, 2)
TIERS: tuple[str, ...] = ("hbm", "host", "host+nvme")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS: tuple[str, ...] = ("critical", "error", "warning", "info", "debug")
# The engine's attention kernels: workers/engine/attention.py KERNEL_CHOICES (a test keeps the two equal).
KERNELS: tuple[str, ...] = ("auto", "ops", "reference")
# The summary build's eigensolver on CUDA (kernels/summary.py EIGH_SOLVERS) and the bits a pass of
# the selection's threshold search fixes (kernels/triton/select.py RADIX_BITS_CHOICES); tests keep
# each equal to the kernels'.
SUMMARY_EIGH: tuple[str, ...] = ("auto", "torch", "jacobi")
RADIX_BITS: tuple[int, ...] = (1, 2)
# Where the hot-page cache's commit runs (offload/cache.py COMMITS; a test keeps the two equal).
CACHE_COMMITS: tuple[str, ...] = ("fused", "branch", "launch", "inline")

AttentionMode = Literal["locks", "dense", "oracle", "quest", "centroid", "shared_sequence", "shared_global"]
GroupRule = Literal["share_average", "group_max", "group_mass"]
Tier = Literal["hbm", "host", "host+nvme"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
Kernels = Literal["auto", "ops", "reference"]
SummaryEigh = Literal["auto", "torch", "jacobi"]
RadixBits = Literal[1, 2]
CacheCommit = Literal["fused", "branch", "launch", "inline"]

DEFAULT_MODEL_SOURCE = "default"


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which model to serve and where its weights run."""

    source: str = Field(
        DEFAULT_MODEL_SOURCE,
        min_length=1,
        description='"default" for the embedded SmolLM2-135M-Instruct GGUF, else a GGUF file or HF directory',
    )
    name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="name served by /v1/models; None derives it from source",
    )
    dtype: DType = Field(
        "auto", description="weight/activation dtype; auto = bfloat16 on GPU, float32 on CPU"
    )
    device: str = Field("auto", description="device of the model weights: auto, cpu, cuda or cuda:N")
    kernels: Kernels = Field(
        "auto", description="attention kernels: auto (CUDA / Triton on a GPU, the torch reference on CPU), "
        "ops (the CUDA / Triton kernels everywhere; on CPU Triton's interpreter, for tests), "
        "reference (torch)",
    )
    cpu_threads: int | None = Field(
        None, ge=1, le=4096,
        description="torch threads of a worker running on CPU; None = its share of its Ray node's CPUs "
        "but one, left to the HTTP front end and Ray (Ray alone would leave it one: it sets OMP_NUM_THREADS "
        "to an actor's num_cpus)",
    )
    max_model_len: OptionalTokens = Field(
        None, ge=16, le=1 << 24,
        description="prompt + completion tokens; None = the model's maximum context (its config.json's "
        "max_position_embeddings, or what its rope scaling reaches); more is an error unless "
        "allow_long_max_model_len",
    )
    allow_long_max_model_len: bool = Field(
        False,
        description="let max_model_len pass the model's maximum context: the model runs past the "
        "positions it was trained on (the workers warn)",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return device


class CacheConfig(_Section):
    """KV pages, LOCKS summaries, the selection budget and where full pages live."""

    page_size: int = Field(16, ge=2, le=256, description="tokens per KV page (B)")
    rank: int = Field(8, ge=1, le=64, description="components kept per page summary (r)")
    basis_bits: int = Field(
        4, ge=2, le=16, description="bits per basis entry: 16 (bf16), 8, 4 or 2 (a scale per column)"
    )
    budget_tokens: Tokens = Field(
        512, ge=2, le=1 << 24, description="tokens attended per KV head per decode step (LOCKS budget b)"
    )
    attention: AttentionMode = Field(
        "locks",
        description="page selector: locks (LOCKS summaries), dense (every page), or an evaluation baseline: "
        "oracle (exact LSE from all keys), quest, centroid, shared_sequence, shared_global",
    )
    group_rule: GroupRule = Field(
        "share_average",
        description="how a GQA group's query heads combine page scores: share_average (Eq. 5), group_max, "
        "group_mass",
    )
    shared_rank: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="rank of the shared_sequence / shared_global bases; None = the largest whose summary "
        "fits LOCKS's payload bytes",
    )
    tier: Tier = Field("host", description="where full KV pages live: hbm, host shared memory, or host+nvme")
    host_capacity_gib: float = Field(8.0, gt=0, le=65536, description="host page-arena size per node, GiB")
    nvme_dir: str | None = Field(
        None, min_length=1, description="directory for spilled pages (tier host+nvme)"
    )
    nvme_capacity_gib: float = Field(
        64.0, gt=0, le=1 << 20, description="NVMe spill space per node, GiB (tier host+nvme: KV capacity is "
        "host_capacity_gib + this; a page is in one of them)")
    nvme_lookahead: int = Field(
        2, ge=0, le=16, description="host+nvme: after each step, promote from NVMe the pages each row would "
        "select at this multiple of its budget, so the next step finds them in host memory (0: off; not 1)",
    )
    nvme_io_threads: int = Field(
        4, ge=1, le=256, description="host+nvme: threads that read and write NVMe pages (each batch is split "
        "between them; random 4 KiB reads need queue depth)",
    )
    nvme_spill_behind: bool = Field(
        True, description="host+nvme: write the spills the next allocation will need behind the step that "
        "made the pages (the pages stay readable in host memory until their write lands); off: spill "
        "inline, when an allocation finds the host arena full",
    )
    nvme_saved_spills: bool = Field(
        True, description="host+nvme with persisted prefixes: a cached page whose prefix record is on disk "
        "spills without a write (its K/V is read back from the record); off: it is written again as a spill",
    )
    nvme_wait_for_saves: bool | None = Field(
        None, description="host+nvme with persisted prefixes and saved spills: an allocation that would "
        "spill a page with a write waits for the prefix store's queued saves instead (their pages then leave "
        "without a write), and spills written behind take saved pages only; default (null): on wherever "
        "nvme_saved_spills is on (a 32K prefill with half the document on NVMe: 1.55 x locks:hbm against "
        "3.11 x without it, docs/results/prefill_llama8b_nvme_wait_h100.json)",
    )
    hot_cache_pages: int | Literal["auto"] = Field(
        AUTO, description="GPU hot-page cache slots per worker; 0 disables the cache; auto = "
        f"{HOT_CACHE_AUTO_PAGES} on a GPU, none on CPU (there it would copy host memory into host memory)"
    )
    hot_cache_commit: CacheCommit = Field(
        "inline", description="where the hot cache's commit (way stamps, counters) runs: inline (each "
        "lookup program stamps its own way; the engine's step advances the cache's), fused (in the lookup "
        "launch), launch (a second launch) or branch (a second launch on a side stream)",
    )
    prefix_reuse: bool = Field(
        True, description="reuse the KV pages and summaries of a prompt's longest cached prefix (full pages "
        "keyed by a hash chain of their tokens; exact); off for benchmarks that need cold prefills",
    )
    prefix_nvme_gib: float = Field(
        64.0, ge=0, le=1 << 20, description="host+nvme: NVMe space in nvme_dir for cached prefixes kept "
        "across restarts (each cached page's K/V and summaries, written by a background thread; least "
        "recently used go first; 0: none)",
    )
    prefix_save_mib: float = Field(
        1024.0, gt=0, le=1 << 20, description="host+nvme: K/V a save of cached pages writes as one segment, "
        "MiB; a long prompt's pages are saved a segment at a time while it is prefilled (while they are "
        "still in host memory), the rest at its end",
    )
    idle_summary_gib: float | None = Field(
        None, ge=0, le=65536, description="GPU memory for the summaries of cached prefixes no running "
        "request reads, GiB; past it the least recently used move to host memory, back on reuse (0: none "
        "stay). None (default): off, all stay on the GPU, because moving them frees no GPU memory yet (the "
        "table keeps a row for every page id until the scorer maps page ids to rows) and a reuse would "
        "wait for them to come back",
    )
    prefill_window_tokens: Tokens = Field(
        131072, ge=0, le=1 << 24, description="host tiers: tokens of the requests being prefilled whose KV "
        "stays on the GPU until their prefill ends, so a chunk attends its prefix in HBM instead of reading "
        "it back over PCIe (capped at max_model_len; GPU bytes: these tokens x KV bytes per token; 0: off)",
    )
    summary_eigh: SummaryEigh = Field(
        "auto", description="the summary build's eigensolver on CUDA: torch (torch.linalg.eigh: waits for "
        "the device), jacobi (a Triton kernel: no host wait, so decode-step builds can be captured) or auto "
        "(jacobi; it beat torch on a prefill chunk's build; the same summaries)",
    )
    select_radix_bits: RadixBits = Field(
        1, description="bits a pass of the Triton selection's threshold search fixes: 1 bisects (measured), "
        "2 fixes two (packed counts, not yet run on a GPU); the same pages either way",
    )
    sink_pages: int = Field(1, ge=0, le=1024, description="leading pages always selected (attention sink)")
    recent_pages: int = Field(
        2, ge=1, le=1024, description="trailing pages always selected (>= 1: the open page has no summary)"
    )

    @field_validator("basis_bits")
    @classmethod
    def _check_basis_bits(cls, bits: int) -> int:
        if bits not in BASIS_BITS:
            raise ValueError(f"must be one of {', '.join(map(str, BASIS_BITS))}")
        return bits

    @field_validator("hot_cache_pages", mode="plain")
    @classmethod
    def _check_hot_cache(cls, value: object) -> int | str:
        if value == AUTO:
            return AUTO
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 26:
            raise ValueError(f"must be 'auto' or an integer in [0, {1 << 26}]")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> CacheConfig:
        if self.rank > self.page_size:
            raise ValueError(f"rank ({self.rank}) must be <= page_size ({self.page_size})")
        if self.budget_tokens % self.page_size:
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must be a multiple of page_size ({self.page_size})"
            )
        fixed = self.sink_pages + self.recent_pages
        if self.budget_tokens // self.page_size <= fixed:  # at least one page chosen by score
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must cover more than sink_pages + recent_pages "
                f"({fixed} pages = {fixed * self.page_size} tokens)"
            )
        if self.nvme_lookahead == 1:
            raise ValueError("nvme_lookahead must be 0 (off) or >= 2: 1 x the budget is the selection itself")
        if self.tier == "host+nvme" and self.nvme_dir is None:
            raise ValueError("nvme_dir must be set when tier is 'host+nvme'")
        if self.nvme_wait_for_saves and not self.nvme_saved_spills:
            raise ValueError("nvme_wait_for_saves (true) needs nvme_saved_spills (false): a finished save "
                             "frees room only when its pages spill without a write")
        return self

    @property
    def waits_for_saves(self) -> bool:
        """nvme_wait_for_saves as it applies: its default (None) follows nvme_saved_spills."""
        return self.nvme_saved_spills if self.nvme_wait_for_saves is None else self.nvme_wait_for_saves

    def hot_cache_slots(self, on_gpu: bool) -> int:
        """hot_cache_pages with auto resolved for a worker on a GPU or not (0: no cache)."""
        if self.hot_cache_pages != AUTO:
            return self.hot_cache_pages
        return HOT_CACHE_AUTO_PAGES if on_gpu else 0


class ServeCacheConfig(CacheConfig):
    """CacheConfig as `lockserve serve` reads it: the host arena may be sized on each node.

    host_capacity_gib "auto": the node's page store takes HOST_AUTO_FRACTION of the memory
    available when it starts (and no more than its shared-memory filesystem has free), and each
    worker reserves only what max_num_seqs sequences of max_model_len tokens can use
    (workers/memory.py). `resolved` gives the plain CacheConfig the engine reads.
    """

    host_capacity_gib: float | Literal["auto"] = Field(
        AUTO, description='host page-arena size per node, GiB; "auto" sizes it from the memory free there'
    )

    @field_validator("host_capacity_gib", mode="plain")
    @classmethod
    def _check_capacity(cls, value: object) -> float | str:
        if value == AUTO:
            return AUTO
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 65536:
            raise ValueError("must be 'auto' or a number of GiB in (0, 65536]")
        return float(value)

    def resolved(self, host_capacity_gib: float) -> CacheConfig:
        """The engine's CacheConfig with the host capacity settled (GiB, this worker's share)."""
        fields = self.model_dump()
        fields["host_capacity_gib"] = host_capacity_gib
        return CacheConfig(**fields)


class SchedulerConfig(_Section):
    """Continuous batching limits of one engine."""

    max_num_seqs: int = Field(16, ge=1, le=4096, description="sequences decoded together in one step")
    # NOTE: the prefill defaults are the configurations `lockserve bench prefill` measures, so a served
    # prompt prefills as measured: alone in 8,192-token chunks (its prefill rows), beside decoding
    # requests 256 tokens and 8M query x key tokens a chunk, a chunk's forward 4 layers a step (its
    # beside rows: a decoding request's TPOT p99 1.8 x its own alone at 128K on an H100, against
    # 7.3 x with the whole forward in one step; a 32M attention cap cuts that prompt's 99 s to 58 s
    # at 2.7 x: docs/notes/prefill.md).
    max_num_batched_tokens: Tokens = Field(
        8192, ge=1, le=1 << 20, description="tokens (prefill + decode) processed in one step"
    )
    prefill_chunk: Tokens = Field(
        8192, ge=1, le=1 << 20, description="prompt tokens prefilled per step per sequence"
    )
    prefill_chunk_decoding: OptionalTokens = Field(
        256, ge=1, le=1 << 20, description="prompt tokens prefilled per step, over all sequences, while "
        "others decode (a long prefill's steps stay short, so decoding requests keep their pace); "
        "None: prefill_chunk per sequence as when nothing decodes",
    )
    prefill_layers_decoding: int | None = Field(
        4, ge=1, le=1024, description="layers of a prompt chunk's forward run per step while others "
        "decode (the chunk's forward then spans several steps, each decoding request's step carrying a "
        "share of its work); on a GPU with CUDA graphs and one prefilling chunk a step; None: the "
        "whole forward in one step",
    )
    prefill_attention_decoding: OptionalTokens = Field(
        8 << 20, ge=1, le=1 << 50, description="prefill attention work of a step's chunks, over all "
        "of them, while others decode, in query x key tokens (a chunk of n tokens from position p costs "
        "n x (p + n), whether its forward runs in one step or is spread by prefill_layers_decoding, "
        "each step then running its layers' share): late chunks of a long prompt read its whole prefix, "
        "so a token cap alone lets their steps grow with the prompt; at least one prompt token a step "
        "still runs; None: no cap",
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) must be <= "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        return self


class ServerConfig(_Section):
    """The OpenAI-compatible HTTP front end."""

    host: str = Field("127.0.0.1", min_length=1, description="bind address; non-loopback requires api_key")
    port: int = Field(8000, ge=0, le=65535, description="bind port; 0 lets the OS pick a free one")
    api_key: SecretStr | None = Field(
        None,
        description="bearer token required on every request but /health; env LOCKSERVE_API_KEY also works",
    )
    max_body_bytes: int | None = Field(
        None,
        ge=1024,
        le=1 << 31,
        description="largest accepted request body (larger gets 413); None derives it from the model's "
        "context: the largest body whose prompt could still fit",
    )
    max_tokens_limit: Tokens = Field(
        8192, ge=1, le=1 << 24, description="largest max_tokens a request may ask for"
    )
    default_max_tokens: Tokens = Field(
        256, ge=1, le=1 << 24, description="max_tokens when a request omits it"
    )
    log_level: LogLevel = Field("info", description="uvicorn and lockserve log level")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> ServerConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be <= "
                f"max_tokens_limit ({self.max_tokens_limit})"
            )
        if self.api_key is not None and not self.api_key.get_secret_value().strip():
            raise ValueError("api_key must not be empty; leave it unset (null) to disable authentication")
        return self


class RayConfig(_Section):
    """Where the Ray actors run."""

    address: str | None = Field(
        None,
        min_length=1,
        description='None starts a local Ray instance; "auto" or ray://host:port joins one',
    )
    namespace: str = Field(
        "lockserve", min_length=1, max_length=128, description="Ray namespace of the actors"
    )
    num_gpu_workers: int | Literal["auto"] = Field(
        AUTO,
        description='GpuWorker actors (one GPU each); "auto" = one per GPU of the lockserve nodes (one CPU '
        "worker when there is no GPU)",
    )
    cpu_only: bool = Field(False, description="run workers on CPU (no GPU required); for tests and laptops")
    restart_backoff_s: float = Field(
        1.0, ge=0, le=3600, description="delay before a crashed worker restarts; doubles per quick re-crash"
    )
    restart_backoff_max_s: float = Field(
        60.0, ge=0, le=86400, description="cap on the restart delay (restarts are never capped in number)"
    )
    wait_for_gpus_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="joining a cluster: how long to wait for GPU nodes to join before failing",
    )

    @field_validator("num_gpu_workers", mode="plain")
    @classmethod
    def _check_workers(cls, value: object) -> int | str:
        if value == AUTO:
            return AUTO
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise ValueError("must be 'auto' or an integer in [1, 4096]")
        return value

    @model_validator(mode="after")
    def _check_backoff(self) -> RayConfig:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s ({self.restart_backoff_max_s}) must be >= "
                f"restart_backoff_s ({self.restart_backoff_s})"
            )
        return self


class ContextParallelConfig(_Section):
    """One request over several nodes: ranks that shard a request too large for one worker."""

    ranks: int = Field(
        0, ge=0, le=1024,
        description="context-parallel rank actors (whole model + a share of a long request's pages each), "
        "one per lockserve node where nodes allow (STRICT_SPREAD); 0 = off",
    )
    host_capacity_gib: float = Field(
        8.0, gt=0, le=65536,
        description="KV pages per rank, GiB (a region of its node's page store on tier host; HBM on hbm)",
    )
    max_requests: int = Field(4, ge=1, le=256, description="sharded requests one rank holds at once")
    timeout_s: float = Field(
        120.0, gt=0, le=86400,
        description="a collective waiting longer than this fails its request (a peer that stopped answering)",
    )


class ServeConfig(_Section):
    """Everything ``lockserve serve`` needs, one section per concern."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the served model")
    cache: ServeCacheConfig = Field(
        default_factory=ServeCacheConfig, description="KV pages, summaries, budget, tiers"
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="batching limits")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP front end")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray placement")
    context_parallel: ContextParallelConfig = Field(
        default_factory=ContextParallelConfig, description="requests sharded over ranks on several nodes"
    )

    @model_validator(mode="after")
    def _check_cross_sections(self) -> ServeConfig:
        if self.ray.cpu_only and self.model.device.startswith("cuda"):
            raise ValueError(f"model.device ({self.model.device!r}) conflicts with ray.cpu_only (true)")
        return self
