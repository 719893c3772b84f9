"""lockserve.workers.engine: requests in, one continuous-batching step at a time, tokens out.

`Engine` (engine.py) drives one model on one device; admission.py decides what it can ever
serve (`EngineLimits`), scheduler.py plans each step over `Sequence`s (sequence.py),
kv_manager.py places the KV pages on their tier, attention.py is the paged attention backend
the model calls, sampling.py picks the next tokens, uploads.py moves host lists to the device,
request.py holds what crosses to a client (`RequestOptions` in, `TokenEvent` out).
It runs any model that follows `lockserve.workers.model.AttentionFn`; model/ never imports it.
"""

from .admission import EngineLimits
from .engine import Engine
from .request import RequestOptions, TokenEvent
from .sampling import SamplingParams
from .sequence import StepOutput

__all__ = ["Engine", "EngineLimits", "RequestOptions", "SamplingParams", "StepOutput", "TokenEvent"]
