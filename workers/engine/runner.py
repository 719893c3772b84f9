"""The model runner: one forward per step, the decode step replayed from CUDA graphs.

    runner = ModelRunner(model, kv, attention, max_num_seqs, max_pages_per_seq, scored)
    batch = Batch(runner.order(batch.decodes), batch.prefills)   # decode rows in row order
    logits = runner.execute(batch, planned)                      # [sampled rows, vocab] float32

The decode rows' state lives on the device across steps (`DecodeState`: page tables written once
per sequence, eight int32 fields per row uploaded in one copy per step). A decode-only step on
CUDA replays a graph captured for its key (batch bucket, page-table width bucket, selection
width, scored): embedding, every layer (RoPE + KV write, scoring, selection, hot-cache lookup
and fill, attention), the final norm and the LM head. Sampling runs after it, eagerly; reading
the sampled ids back is the step's one host wait. The first step of a key runs eagerly with the
key's padded shapes (warming every kernel), then the key is captured: no step runs twice.
A step with prefill chunks beside decode rows runs them apart: the rows as a decode-only step
(replayed), then the chunks in an eager prefill-only forward; steps on CPU run the whole batch
eagerly in one forward with exact shapes. On tier host+nvme a step that selected a page still on
NVMe runs again after promoting it (one synchronous read; the miss count is the step's second
host wait on that tier). `pad_decode` runs decode rows at their key's padded shapes without
graphs, and apart from the chunks beside them (what a replay computes: CPU tests of the
bucketing and of the split use it).
Beside decode rows the chunks' forward may also be spread over steps, a few layers a step
(`execute`'s layers, scheduler.prefill_layers_decoding): the runner keeps its state between
layers (`inflight`), and the step whose part reaches the last layer gives the chunks' logits. An
eager forward of a short chunk is bound by its host's launches over a short prefix (~30-40 ms for
32 layers on the lent machines) and by its attention over a long one (docs/notes/prefill.md), so
each step of a decoding request then carries a share of it, not all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .attention import PagedAttention, StepPlan, decode_plan, plan_step
from .decode_state import DecodeState, width_bucket
from .graphs import GraphKey, KeyedGraphs
from .kv_manager import KVManager
from .scheduler import Batch
from .uploads import upload

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class ForwardState:
    """An eager forward between layers: what its next layer `layer` needs. plan: the step plan it
    attends (bound before each part); x: [T, hidden] the output of layer `layer - 1` (the
    embeddings at 0); residual: the stream before it (None at 0); ropes: Model.ropes of its
    positions; rows: the rows of x that sample, in token order; request_ids: its chunks'
    sequences; planned: KVManager.plan of each chunk (made once: planning takes locations)."""

    plan: StepPlan
    x: torch.Tensor
    residual: torch.Tensor | None
    ropes: tuple
    rows: list[int]
    request_ids: tuple[str, ...]
    planned: list[list[int]]
    layer: int = 0


def batch_bucket(n: int, max_rows: int) -> int:
    """Smallest bucket >= n (buckets past max_rows are capped at it)."""
    return min(next(b for b in BATCH_BUCKETS if b >= n) if n <= BATCH_BUCKETS[-1] else n, max_rows)


class ModelRunner:
    """Runs the model over the engine's paged KV (see the module docstring).

    scored: the engine attends selections of scored pages (False: dense, every page). use_graphs:
    replay decode steps from CUDA graphs where the device and tier allow (None: wherever they do).
    graph_blocker: why this engine's decode step must not be captured (a page selector that is not
    capturable, engine/selectors.py), or None; with it use_graphs None runs eagerly and True is an
    error. eager_reason: why decode steps run eagerly (None when they replay graphs).
    pad_decode: run decode rows at their graph key's padded shapes, apart from any prefill chunks
    beside them (on with graphs).
    """

    def __init__(self, model, kv: KVManager, attention: PagedAttention, max_num_seqs: int,
                 max_pages_per_seq: int, scored: bool, use_graphs: bool | None = None,
                 graph_blocker: str | None = None):
        self.model, self.kv, self.attention, self.scored = model, kv, attention, scored
        self.device = kv.device
        self.state = DecodeState(max_num_seqs, max_pages_per_seq, kv.layout.page_size, self.device)
        can = self.device.type == "cuda"
        if use_graphs and not can:
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if use_graphs and graph_blocker:
            raise ValueError(f"use_graphs (True): {graph_blocker}")
        self.use_graphs = (can and graph_blocker is None) if use_graphs is None else use_graphs
        self.eager_reason = None if self.use_graphs else (
            "use_graphs (False)" if use_graphs is False else graph_blocker if can
            else f"CUDA graphs need a CUDA device, not {self.device}")
        self.pad_decode = self.use_graphs
        self.min_width = 64  # narrowest page-table width of a graph (pages)
        self.last_padded: tuple[int, GraphKey] | None = None  # (live rows, key) of the last padded step
        # Captured decode steps by GraphKey, each returning logits [rows, vocab] float32.
        self.graphs = KeyedGraphs(torch.cuda.graph_pool_handle() if self.use_graphs else None)
        self._steps = {"eager_steps": 0, "split_steps": 0, "prefill_parts": 0}
        # The prefill chunk whose forward runs over several steps (execute's `layers`), between
        # two of its parts; None when no forward is under way. Invariant: while set, every step's
        # batch.prefills is that forward's one chunk (Scheduler.pinned).
        self.inflight: ForwardState | None = None

    # ---- rows ----------------------------------------------------------------------------------

    def order(self, decodes: list) -> list:
        """This step's decode chunks in row order (newcomers get rows)."""
        return self.state.order(decodes)

    def release(self, request_id: str) -> None:
        self.state.remove(request_id)
        if self.inflight is not None and request_id in self.inflight.request_ids:
            self.inflight = None  # its pages go with the sequence; no part of it runs again

    # ---- the step ------------------------------------------------------------------------------

    def execute(self, batch: Batch, planned: list[list[int]],
                layers: int | None = None) -> torch.Tensor | None:
        """Run one step's forward; returns the logits of the rows that sample, in token order:
        every decode row, then each prefill chunk that reaches its sequence's end (None when no
        row samples). batch.decodes
        must be in row order (`order`); planned: KVManager.plan of each chunk.
        layers: where the chunks run apart from decode rows (pad_decode), run only this many more
        layers of their forward (None: the rest of it); `inflight` is then set until a later
        step's part reaches the last layer, and only that step gives the chunks' logits."""
        nd = len(batch.decodes)
        if nd:
            self.state.stage(batch.decodes, [locs[-1] for locs in planned[:nd]])
        # NOTE: a forward that runs again (host+nvme misses) starts again from `inflight`, which
        # only the forward that stands replaces.
        logits, self.inflight = self.kv.run_forward(
            lambda: self._forward(batch, planned, layers), lambda: (self._eager(batch, planned), None),
            decodes=nd > 0)
        return logits

    def _forward(self, batch: Batch, planned: list[list[int]],
                 layers: int | None) -> tuple[torch.Tensor | None, ForwardState | None]:
        nd = len(batch.decodes)
        if self.inflight is not None and not nd:  # the decode rows left: the rest of its layers now
            return self._prefill_part(batch, planned, None, new_step=True)
        if not nd or not self.pad_decode:
            self._steps["eager_steps"] += 1
            return self._eager(batch, planned), None
        logits = self._decode_padded(nd)  # [nd, vocab]
        if not batch.prefills:
            return logits, None
        if layers is not None or self.inflight is not None:
            self._steps["split_steps"] += 1
            rest, state = self._prefill_part(batch, planned, layers, new_step=False)
            return (logits if rest is None else torch.cat([logits, rest])), state
        # NOTE: beside a prefill the decode rows still replay their graph and the chunks run in a
        # forward of their own: one eager mixed forward is host-bound (~3,000 aten calls and ~350
        # Triton launches a step on the H200, 45.6 ms against 4.66 ms replayed:
        # docs/results/beside_step_probe_h200.json), and a decoding request would pay it every step
        # a long prompt prefills. The weights are read twice; the host work of the decode rows is
        # one replay. The rows' K/V writes and the chunks' touch different pages, so the two
        # forwards commute.
        self._steps["split_steps"] += 1
        rest = self._eager(Batch([], batch.prefills), planned[nd:], new_step=False)  # [sampled, vocab]
        return (logits if rest is None else torch.cat([logits, rest])), None

    def _prefill_part(self, batch: Batch, planned: list[list[int]], layers: int | None,
                      new_step: bool) -> tuple[torch.Tensor | None, ForwardState | None]:
        """`layers` more layers (None: the rest) of the forward of batch.prefills, from `inflight`
        or from its start: (the sampled rows' logits when the forward ended, else None; the state
        when it did not). new_step: no decode rows ran before it in this step."""
        nd = len(batch.decodes)
        f = self.inflight or self._start(Batch([], batch.prefills), planned[nd:])
        self._steps["prefill_parts"] += 1
        self.attention.bind(f.plan)
        if new_step:
            self.kv.begin_forward()
        total = len(self.model.layers)
        end = total if layers is None else min(total, f.layer + max(1, layers))
        x, residual = self.model.run_layers(f.x, f.residual, f.ropes, self.attention, f.layer, end)
        self.kv.join()
        if end < total:
            return None, replace(f, x=x, residual=residual, layer=end)
        return self._logits(self.model.final_norm(x, residual), f.rows), None

    def _scored(self, n: int) -> bool:
        """Whether any of rows 0..n-1 has more pages than its budget (else no scoring needed).
        NOTE: per row, not max selected < max pages: a row whose budget covers the longest row's
        pages must not make a shorter-budget row in the same batch attend every page."""
        return self.scored and self.state.any_pruned(n)

    def _eager(self, batch: Batch, planned: list[list[int]], new_step: bool = True) -> torch.Tensor | None:
        """One eager forward over the batch. new_step False: prefill chunks beside decode rows that
        have just run (the chunks look no page up in the hot cache, whose step the rows began)."""
        plan, input_ids, positions, rows = self._inputs(batch, planned)
        self.attention.bind(plan)
        if new_step:
            self.kv.begin_forward()
        hidden = self.model(input_ids, positions, self.attention)  # [T, hidden]
        self.kv.join()
        return self._logits(hidden, rows)

    def _start(self, batch: Batch, planned: list[list[int]]) -> ForwardState:
        """A forward of prefill chunks before its first layer (to be run in parts)."""
        plan, input_ids, positions, rows = self._inputs(batch, planned)
        return ForwardState(plan, self.model.embed(input_ids), None, self.model.ropes(positions), rows,
                            tuple(chunk.seq.request_id for chunk in batch.prefills), planned)

    def _inputs(self, batch: Batch, planned: list[list[int]]) -> tuple[StepPlan, torch.Tensor, torch.Tensor,
                                                                          list[int]]:
        """An eager forward's plan, input ids [T] and positions [T] (decode rows from the staged
        state, then the chunks' tokens) and the rows that sample, in token order."""
        nd = len(batch.decodes)
        prefixes = [self.kv.prefix(chunk) for chunk in batch.prefills]
        plan = plan_step(batch, planned, self.kv.layout.page_size, self.state, self._scored(nd), self.device,
                         prefixes)
        ids, pos = [], []
        for chunk in batch.prefills:
            ids.extend(chunk.seq.token_slice(chunk.start, chunk.end))
            pos.extend(range(chunk.start, chunk.end))
        input_ids, positions = self.state.field("token", nd), self.state.field("position", nd)
        if ids:
            input_ids = torch.cat([input_ids.long(), upload(ids, dtype=torch.int64, device=self.device)])
            positions = torch.cat([positions.long(), upload(pos, dtype=torch.int64, device=self.device)])
        rows, offset = list(range(nd)), nd
        for chunk in batch.prefills:
            offset += chunk.num_tokens
            if chunk.sample:
                rows.append(offset - 1)
        return plan, input_ids, positions, rows

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """hidden [T, hidden] -> the logits of `rows` [len(rows), vocab] (None for no row)."""
        if not rows:
            return None
        if len(rows) == hidden.shape[0]:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[upload(rows, dtype=torch.int64, device=self.device)])

    def _key(self, n: int) -> GraphKey:
        state = self.state
        width = min(width_bucket(state.max_pages_of(n), self.min_width), state.max_pages)
        scored = self._scored(n)
        # Unscored rows attend every page, and each has no more pages than its budget: k need not
        # pass the largest budget, however wide the bucket. Off tier hbm that budget is at most the
        # engine's, which sizes the tier's read rows (rows x KV heads x k must fit them).
        k = min(state.max_selected_of(n) if scored else state.max_budget_of(n), width)
        return GraphKey(batch_bucket(n, state.max_rows), width, k, scored)

    def _forward_decode(self, key: GraphKey) -> torch.Tensor:
        """The decode-only forward over rows 0..key.rows-1 (null rows past the live ones)."""
        state = self.state
        self.attention.bind(decode_plan(state, key.rows, key.width, key.k, key.scored))
        self.kv.begin_forward()  # captured: the replay advances the hot cache's step
        hidden = self.model(state.field("token", key.rows), state.field("position", key.rows), self.attention)
        self.kv.join()  # inside a capture: side-stream work joins before it ends
        return self.model.compute_logits(hidden)  # [rows, vocab]

    def _decode_padded(self, n: int) -> torch.Tensor:
        key = self._key(n)
        self.last_padded = (n, key)
        step = self.graphs.get(key)
        if step is None:
            logits = self._forward_decode(key)  # this step's answer, and the warm-up of the capture
            if self.use_graphs:
                self.graphs.capture(key, lambda: self._forward_decode(key))
            self._steps["eager_steps"] += 1
            return logits[:n]
        return self.graphs.replay(step)[:n]

    @property
    def counters(self) -> dict[str, int]:
        """Steps by how they ran: graph_replays, graph_captures, eager_steps, split_steps."""
        return {"graph_replays": self.graphs.replays, "graph_captures": self.graphs.captures, **self._steps}

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)
