"""`LLM`: the offline Python API over one Engine (what `lockserve generate` calls).

    llm = LLM("default", attention="locks", tier="hbm", budget_tokens=512)
    [c] = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=64))
    for out in llm.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(out.text, end="")

model: "default" (the embedded SmolLM2-135M-Instruct GGUF), a preset name such as "tiny"
(random weights, byte-level tokenizer), "preset:<name>", a Hugging Face folder or a .gguf file.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig

from .engine import Engine, RequestOptions
from .engine.sampling import SamplingParams
from .engine.sequence import StepOutput
from .model.loader import fit_positions, load_model
from .model.presets import PRESETS, build_preset
from .sampling_defaults import sampling_defaults

log = logging.getLogger(__name__)

DEFAULT_KV_CAPACITY_TOKENS = 32768


@dataclass
class Completion:
    """A finished request: text (stop strings and stop-token text removed), token ids (a stop
    token id included), finish_reason "stop" | "length" | "abort"."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load(model: str, device: torch.device, dtype: torch.dtype | None, seed: int):
    """(model, tokenizer) for a preset name, "default", "preset:<name>", a folder or a .gguf file."""
    if model in PRESETS:
        return build_preset(model, seed=seed, device=device, dtype=dtype)
    return load_model(model, device=device, dtype=dtype)


class LLM:
    """One model, one engine. Keyword arguments are CacheConfig / SchedulerConfig fields (validated
    there, errors name field and value), plus: kv_capacity_tokens (KV pages reserved, in tokens;
    on host+nvme the logical capacity, host memory being host_capacity_gib), max_model_len (None:
    the model's maximum context; past it a ValueError naming both, unless
    allow_long_max_model_len: then the model runs past it, with a warning), seed,
    show_progress (tqdm bar while long prompts prefill).

    Sampling: params None, or a dict, take the model's own defaults (generation_config.json's
    temperature, top_p, top_k; workers/sampling_defaults.py) for what they leave out, as served
    requests do; a SamplingParams is used as given."""

    def __init__(self, model: str = "default", *, attention: str = "locks", tier: str = "hbm",
                 budget_tokens: int = 512, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
                 max_model_len: int | None = None, allow_long_max_model_len: bool = False, seed: int = 0,
                 show_progress: bool = False, **config):
        cache_fields, sched_fields = set(CacheConfig.model_fields), set(SchedulerConfig.model_fields)
        unknown = sorted(set(config) - cache_fields - sched_fields)
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}; known: {sorted(cache_fields | sched_fields)}")
        if kv_capacity_tokens <= 0:
            raise ValueError(f"kv_capacity_tokens ({kv_capacity_tokens}) must be > 0")
        cache = CacheConfig(attention=attention, tier=tier, budget_tokens=budget_tokens,
                            **{k: v for k, v in config.items() if k in cache_fields})
        sched = SchedulerConfig(**{k: v for k, v in config.items() if k in sched_fields})
        self.device = resolve_device(device)
        self.model, self.tokenizer = load(model, self.device, dtype, seed)
        trained = fit_positions(self.model, max_model_len, allow_long_max_model_len, model)
        if trained is not None:
            log.warning("max_model_len (%d) runs %s past its %d trained positions "
                        "(allow_long_max_model_len)", max_model_len, model, trained)
        self.engine = Engine(self.model, self.tokenizer, cache, sched, self.device,
                             max_pages=math.ceil(kv_capacity_tokens / cache.page_size),
                             max_model_len=max_model_len, seed=seed, show_progress=show_progress)
        self.sampling_defaults = _usable_defaults(sampling_defaults(model))
        self._ids = itertools.count()
        self._pending: dict[str, list[StepOutput]] = {}
        self._prompts: dict[str, list[int]] = {}

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a list of ids passes through)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat ([{"role", "content"}, ...]) with the model's template."""
        return self.tokenizer.encode_chat(messages)

    def sampling_params(self, params: SamplingParams | dict | None = None) -> SamplingParams:
        """The SamplingParams a request runs with: ``params`` over the model's defaults."""
        if isinstance(params, SamplingParams):
            return params
        return SamplingParams(**{**self.sampling_defaults, **(params or {})})

    def _submit(self, prompt, params, options) -> str:
        rid = f"llm-{next(self._ids)}"
        ids = self.encode(prompt)
        self.engine.add_request(rid, ids, self.sampling_params(params), RequestOptions.coerce(options))
        self._pending[rid] = []
        self._prompts[rid] = ids
        return rid

    def _drive(self) -> None:
        """One engine step; outputs go to their request's queue."""
        for out in self.engine.step():
            self._pending.setdefault(out.request_id, []).append(out)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 options: RequestOptions | None = None) -> list[Completion]:
        """Complete every prompt (a string, a list of ids, or a list of either), batched together.
        Returns the completions in prompt order. A bad prompt raises before any work starts."""
        batch = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"params ({len(plist)} items) must match prompts ({len(batch)} items)")
        rids: list[str] = []
        try:
            for prompt, p in zip(batch, plist, strict=True):
                rids.append(self._submit(prompt, p, options))
        except Exception:
            for rid in rids:
                self._cancel(rid)
            raise
        while any(not self._done(rid) for rid in rids):
            self._drive()
        return [self._collect(rid) for rid in rids]

    def stream(self, prompt, params: SamplingParams | None = None,
               options: RequestOptions | None = None) -> Iterator[StepOutput]:
        """Yield one StepOutput per new token of one prompt; the last has finished=True. Closing the
        iterator early aborts the request."""
        rid = self._submit(prompt, params, options)
        try:
            while True:
                queue = self._pending[rid]
                while queue:
                    out = queue.pop(0)
                    yield out
                    if out.finished:
                        return
                self._drive()
        finally:
            self._cancel(rid)

    def _done(self, rid: str) -> bool:
        outs = self._pending[rid]
        return bool(outs) and outs[-1].finished

    def _collect(self, rid: str) -> Completion:
        outs = self._pending.pop(rid)
        return Completion(
            request_id=rid,
            prompt_token_ids=self._prompts.pop(rid),
            text="".join(o.text for o in outs),
            token_ids=[t for o in outs for t in o.token_ids],
            finish_reason=outs[-1].finish_reason,
        )

    def _cancel(self, rid: str) -> None:
        self.engine.abort(rid)
        self._pending.pop(rid, None)
        self._prompts.pop(rid, None)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _usable_defaults(defaults: dict) -> dict:
    """The model's sampling defaults that SamplingParams accepts; a bad one is dropped with a
    warning (it must not fail every call that leaves the field out)."""
    kept = {}
    for key in ("temperature", "top_p", "top_k"):
        if key not in defaults:
            continue
        try:
            SamplingParams(**{key: defaults[key]})
        except ValueError as error:
            log.warning("ignoring the model's sampling default %s from %s: %s", key,
                        defaults.get("source"), error)
            continue
        kept[key] = defaults[key]
    return kept


def _is_ids(value) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)
