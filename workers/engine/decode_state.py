"""The decode rows' state, kept on the device across steps (the persistent batch).

Every sequence that decodes holds a row; rows are compact (0 .. n-1) and a step's decode tokens
come in row order. Per row the device holds its page table (written once, when the row is
taken: a sequence's page ids are fixed from admission to its end) and eight int32 fields,
staged on the host and uploaded together in one copy per step:

    token       the token the step feeds (the last sampled one)
    position    its position
    num_pages   pages after this token, the open page included
    num_settled full pages (num_pages - 1): in the tier, summarised, scored
    budget      LOCKS page budget (rows whose pages fit it attend all of them)
    tail_len    tokens in the open page after this token; tail_off = tail_len - 1 is where it goes
    tail_loc    write-pool location of the open page (hbm: its page id)

Rows past n are null rows (num_pages 1, tail_len 0, tail_loc -1): a replayed graph of a larger
batch bucket computes them, writes nothing and reads nothing (a length-0 open page).
"""

from __future__ import annotations

import numpy as np
import torch
from lockserve.kernels.select import DecodeRows

from .sequence import Sequence
from .uploads import upload

FIELDS = ("token", "position", "num_pages", "num_settled", "budget", "tail_len", "tail_off", "tail_loc")
F = {name: i for i, name in enumerate(FIELDS)}
NULL_ROW = {"token": 0, "position": 0, "num_pages": 1, "num_settled": 0, "budget": 1 << 30,
            "tail_len": 0, "tail_off": 0, "tail_loc": -1}
DENSE_BUDGET = 1 << 30  # a budget no row reaches: attend every page


class DecodeState:
    """Rows of the decoding sequences and their device tensors (see the module docstring).

    max_rows: rows at most (max_num_seqs); max_pages: page-table columns (pages of the longest
    sequence).
    """

    def __init__(self, max_rows: int, max_pages: int, page_size: int, device: torch.device):
        self.max_rows, self.max_pages, self.page_size, self.device = max_rows, max_pages, page_size, device
        pinned = device.type == "cuda"
        self.host = torch.zeros((len(FIELDS), max_rows), dtype=torch.int32, pin_memory=pinned)
        # NOTE: the per-step writes and reads of the staged fields go through this numpy view of
        # the same memory: a torch element write costs microseconds of dispatch on the host, a
        # numpy one a tenth of one, and the step's host time before its graph replay is device idle.
        self._np = self.host.numpy()  # [F, max_rows] int32, shares self.host's (pinned) memory
        for name, value in NULL_ROW.items():
            self._np[F[name]] = value
        self.meta = self.host.to(device)  # [F, max_rows] int32
        self.page_table = torch.zeros((max_rows, max_pages), dtype=torch.int32, device=device)
        self.seqs: list[Sequence] = []  # row order
        self._rows: dict[str, int] = {}
        self._uploaded = torch.cuda.Event() if pinned else None

    def __len__(self) -> int:
        return len(self.seqs)

    def field(self, name: str, n: int) -> torch.Tensor:
        """[n] int32 device view of one field of rows 0..n-1."""
        return self.meta[F[name], :n]

    def rows(self, n: int, width: int) -> DecodeRows:
        """Views of rows 0..n-1 with `width` page-table columns (>= every row's pages)."""
        f = self.field
        return DecodeRows(self.page_table[:n, :width], f("num_pages", n), f("budget", n), f("tail_len", n),
                          f("tail_loc", n))

    # ---- rows ----------------------------------------------------------------------------------

    def order(self, decodes: list) -> list:
        """Give newcomers rows (appended) and return the chunks in row order. Every row must be
        decoding: the scheduler decodes every running sequence whose prompt is done."""
        for chunk in decodes:
            if chunk.seq.request_id not in self._rows:
                self._add(chunk.seq)
        if len(decodes) != len(self.seqs):
            raise RuntimeError(f"{len(self.seqs)} decode rows but {len(decodes)} decodes in the step")
        return sorted(decodes, key=lambda c: self._rows[c.seq.request_id])

    def _add(self, seq: Sequence) -> None:
        if len(self.seqs) == self.max_rows:
            raise RuntimeError(f"no free decode row: all {self.max_rows} are taken")
        if len(seq.pids) > self.max_pages:
            raise ValueError(f"sequence {seq.request_id!r} has {len(seq.pids)} pages, more than the "
                             f"page table's {self.max_pages} columns")
        row = len(self.seqs)
        self.seqs.append(seq)
        self._rows[seq.request_id] = row
        self.page_table[row, : len(seq.pids)] = upload(seq.pids, dtype=torch.int32, device=self.device)

    def remove(self, request_id: str) -> None:
        """Drop a sequence's row (finished or aborted); the last row moves into the hole."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        last = len(self.seqs) - 1
        if row != last:
            moved = self.seqs[last]
            self.seqs[row] = moved
            self._rows[moved.request_id] = row
            self.page_table[row] = self.page_table[last]
            self._np[:, row] = self._np[:, last]
        self.seqs.pop()
        for name, value in NULL_ROW.items():
            self._np[F[name], last] = value

    # ---- per step ------------------------------------------------------------------------------

    def stage(self, decodes: list, tail_locs: list[int]) -> None:
        """Write this step's fields of rows 0..n-1 (chunks in row order, each one token) and upload
        them with one copy (asynchronous on CUDA). tail_locs: each row's open-page location."""
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()  # the previous upload must have left the staging buffer
        b = self.page_size
        for row, (chunk, loc) in enumerate(zip(decodes, tail_locs, strict=True)):
            seq, pos = chunk.seq, chunk.start
            pages = pos // b + 1
            budget = DENSE_BUDGET if seq.budget_pages is None else seq.budget_pages
            # one row of all FIELDS, in their order
            self._np[:, row] = (seq.token_slice(pos, pos + 1)[0], pos, pages, pages - 1, budget,
                                pos - (pages - 1) * b + 1, pos % b, loc)
        self.meta.copy_(self.host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def max_pages_of(self, n: int) -> int:
        """Most pages of rows 0..n-1 (from the host copy: no device read)."""
        return int(self._np[F["num_pages"], :n].max()) if n else 0

    def any_pruned(self, n: int) -> bool:
        """Whether any of rows 0..n-1 has more pages than its budget (host copy)."""
        pages, budget = self._np[F["num_pages"], :n], self._np[F["budget"], :n]
        return bool((budget < pages).any())

    def max_budget_of(self, n: int) -> int:
        """Largest page budget of rows 0..n-1 (DENSE_BUDGET where a row attends every page; host copy)."""
        return int(self._np[F["budget"], :n].max()) if n else 0

    def max_selected_of(self, n: int) -> int:
        """Most pages any of rows 0..n-1 attends: min(budget, pages) (host copy)."""
        if not n:
            return 0
        pages, budget = self._np[F["num_pages"], :n], self._np[F["budget"], :n]
        return int(np.minimum(pages, budget).max())


def width_bucket(pages: int, min_width: int = 64) -> int:
    """Page-table width a graph is captured for: pages rounded up to a multiple of 1/8 of the power
    of two below them (at most 12.5% padding; a growing sequence changes bucket rarely)."""
    if pages <= min_width:
        return min_width
    step = max(min_width, 1 << (pages.bit_length() - 4))
    return -(-pages // step) * step
