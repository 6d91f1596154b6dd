"""A plan's words on their way to the device: the word map of the workspace's int region, the
pinned staging buffer whose two halves plans take in turn, and the asynchronous copies of the
used words (docs/serving.md#plan--run).

The int32 region of the workspace, and of each staging half, is the packed plan (`PlanLayout`'s
room) followed by the page tables at fixed offsets, each table's room set by the instance's
maxima, so a CUDA graph's kernels find them at the same addresses after every plan.

Example (the word map of a plan room of 112 words, maxima of 4 requests and 64 query tokens):
    >>> from attncc.runtime.serving.plan import scheduler
    >>> lay = scheduler.PlanLayout(4, 64, 2, 1, 1, 16)
    >>> table_offsets(lay, max_batch=4, max_qo_tokens=64)
    {'qo_indptr': 112, 'kv_page_indptr': 120, 'kv_lens': 128, 'kv_pos': 136, 'q_pos': 144, 'pages': 208}
    >>> int_words(lay, max_batch=4, max_qo_tokens=64, max_pages=10)
    220
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from ..jit.launcher import current_raw_stream, driver, driver_check
from .plan import scheduler
from .plan.checks import CheckedBatch

__all__ = ["UPLOAD_GAP", "Staging", "Uploader", "coalesce_ranges", "int_words", "pad4",
           "stage_tables", "table_offsets", "used_ranges"]

UPLOAD_GAP = 16384
"""`used_ranges`' default: int32 words (64 KB) of unused room that one copy may carry between two
used ranges rather than issuing another copy. Each cuMemcpyHtoDAsync costs the host a few
microseconds and the copy engine a fixed start-up; 64 KB of extra copy costs the engine about as
much (~2-3 us over PCIe) and the host nothing. A plan is one range and its page tables another:
one copy when the plan fills its room to within 64 KB, else two."""


def pad4(n: int) -> int:
    """`n` rounded up to a multiple of 4 (int32 words: 16-byte aligned tables)."""
    return (n + 3) // 4 * 4


def int_words(layout: scheduler.PlanLayout, max_batch: int, max_qo_tokens: int,
              max_pages: int) -> int:
    """int32 words of the plan (`layout`'s room) and the page tables after it."""
    return layout.size + 4 * pad4(max_batch + 1) + pad4(max_qo_tokens) + pad4(max_pages)


def table_offsets(layout: scheduler.PlanLayout, max_batch: int,
                  max_qo_tokens: int) -> dict[str, int]:
    """Word offsets of the page tables in the staging buffer (and the workspace): after the
    packed plan of `layout`, each table's room set by the maxima."""
    off = layout.size
    mb = pad4(max_batch + 1)
    qcap = pad4(max_qo_tokens)
    pages = off + 4 * mb + qcap
    return {"qo_indptr": off, "kv_page_indptr": off + mb, "kv_lens": off + 2 * mb,
            "kv_pos": off + 3 * mb, "q_pos": off + 4 * mb, "pages": pages}


def stage_tables(buf: np.ndarray, b: CheckedBatch, o: dict[str, int]) -> None:
    """Write batch `b`'s page tables at the word offsets `o` of the staging buffer `buf` (numpy:
    the compiled planner writes the same words in `BatchPlanner.plan_and_stage`)."""
    buf[o["qo_indptr"]:o["qo_indptr"] + b.qo.size] = b.qo
    buf[o["kv_page_indptr"]:o["kv_page_indptr"] + b.page_indptr.size] = b.page_indptr
    buf[o["kv_lens"]:o["kv_lens"] + b.kv_lens.size] = b.kv_lens
    if b.kvoff is not None:
        buf[o["kv_pos"]:o["kv_pos"] + b.kvoff.size] = b.kvoff
    if b.qpos is not None:
        buf[o["q_pos"]:o["q_pos"] + b.qpos.size] = b.qpos
    npg = int(b.page_indptr[-1]) if b.page_indptr.size else 0
    buf[o["pages"]:o["pages"] + npg] = b.pages[:npg]


def coalesce_ranges(ranges: Iterable[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Half-open ranges `[start, end)`, sorted, with the empty ones dropped and those that
    overlap or lie less than `gap` apart joined into one.

    Example:
        >>> coalesce_ranges([(80, 83), (0, 16), (16, 40), (90, 90), (100, 120)], gap=10)
        [(0, 40), (80, 83), (100, 120)]
        >>> coalesce_ranges([(80, 83), (0, 16), (16, 40), (100, 120)], gap=50)
        [(0, 120)]
    """
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if end <= start:
            continue
        if out and start - out[-1][1] < gap:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def used_ranges(buf: np.ndarray, layout: scheduler.PlanLayout, tables: int, end: int,
                gap: int = UPLOAD_GAP) -> list[tuple[int, int]]:
    """The word ranges of a staged plan that hold data: the packed plan, one range
    `[0, layout.used_words(header))` (its sections sit back to back), then the page tables
    `[tables, end)`, joined by `coalesce_ranges` when less than `gap` words apart.

    The words in the plan's range that no section uses (padding to 16 bytes, cta_indptr's room
    past num_ctas + 1, which Plan.pack fills) and those in a gap are copied too, harmlessly:
    the kernels (kernels/fa2/fa2_batch.cuh, fa3_batch.cuh and the merge) read only used words. They
    read the header's section offsets and counts; the attention grid is layout.max_ctas CTAs,
    which is the plan's num_ctas (BatchAttention sizes the layout by it), and CTA c reads
    cta_indptr[c], [c + 1], then cta_units in [0, num_units) and the units those name; the
    merge kernel's CTAs read merge_out[m], merge_indptr[m], [m + 1] for m < num_merges only;
    the page tables are read per planned request (tests/runtime/serving/test_batch.py,
    test_used_ranges_carry_everything_the_kernels_read, fills the rest with garbage).

    Example:
        >>> from attncc.runtime.serving.plan import scheduler
        >>> lay = scheduler.PlanLayout(4, 64, 2, 1, 1, 16)
        >>> buf = np.zeros(lay.size, np.int32)
        >>> scheduler.plan_into(buf, lay, np.array([0, 40]), np.array([40]), 1, 1, 16, 2)
        >>> used_ranges(buf, lay, lay.size, lay.size + 10, gap=0)  # the plan (3 units), tables
        [(0, 60), (112, 122)]
        >>> len(used_ranges(buf, lay, lay.size, lay.size + 10))    # one copy
        1
    """
    header = dict(zip(scheduler.HEADER_FIELDS, buf[:len(scheduler.HEADER_FIELDS)].tolist()))
    return coalesce_ranges([(0, layout.used_words(header)), (tables, end)], gap)


class Uploader:
    """plan()'s copies to the workspace on one CUDA device: the driver's async copy, the
    current stream (looked up each plan by its raw handle -- the caller may switch streams --
    with torch's Stream object kept while the handle stays the same) and one reusable event per
    staging half, recorded after that half's copies and waited on before the half is written
    again. Made at the first upload (the compiler half imports without CUDA).

    Copies of consecutive plans on one stream land in order; when the stream changes, `copy`
    first waits for the last plan's copies, so an older plan's words never land last."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index or 0
        self.memcpy = driver().cuMemcpyHtoDAsync
        self.current_stream = torch.cuda.current_stream
        self.raw_stream = current_raw_stream
        self.events = (torch.cuda.Event(), torch.cuda.Event())
        self.pending = [False, False]  # per half: its copies may still be reading it
        self._stream: tuple[int, Any] = (-1, None)  # (raw handle, torch.cuda.Stream)

    def copy(self, dst: int, src: int, half: int, ranges: list[tuple[int, int]]) -> None:
        """Copy int32 words `[w0, w1)` of each range from host `src` (staging half `half`) to
        device `dst` on the current stream, then record the half's event there."""
        raw = self.raw_stream(self.index)
        if raw != self._stream[0]:  # another stream than the last plan's (rare):
            self.wait(1 - half)  # its copies land first, as on one stream
            self._stream = (raw, self.current_stream(self.index))
        memcpy = self.memcpy
        for w0, w1 in ranges:
            driver_check(memcpy(dst + 4 * w0, src + 4 * w0, 4 * (w1 - w0), raw),
                         "cuMemcpyHtoDAsync")
        self.events[half].record(self._stream[1])
        self.pending[half] = True

    def wait(self, half: int) -> None:
        """Block until the copies from staging half `half` have read it (none pending: no
        call)."""
        if self.pending[half]:
            self.events[half].synchronize()
            self.pending[half] = False


class Staging:
    """The pinned host buffer plans are written to, in two halves that plans take in turn: a
    plan waits only for the copy of the plan before last (long done in a serving loop), never
    for the copy the last plan just issued. The buffer grows (and only then moves) when a
    layout needs more words; the workspace, not this buffer, is what kernels read.

    Example (on the CPU the buffer is not pinned and there are no copies to wait for):
        >>> from attncc.runtime.serving.plan import scheduler
        >>> st = Staging()
        >>> st.fit(scheduler.PlanLayout(4, 64, 2, 1, 1, 16), 220, {"pages": 208}, None, False)
        >>> half, buf, offsets = st.take(None)
        >>> half, buf.size, offsets
        (0, 220, {'pages': 208})
        >>> st.commit(half, buf); st.take(None)[0]
        1
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # both halves
        self.halves: tuple[np.ndarray, ...] = ()  # numpy views of the two halves
        self.halves_at: tuple[int, ...] = ()  # and their addresses
        self.half = 1  # the half the current plan staged (the next plan takes the other)
        self.current = np.zeros(0, dtype=np.int32)  # the current plan's half
        self.layout: Any = None  # the layout `fit` last sized the halves for
        self.offsets: dict[str, int] = {}  # and the table offsets after its plan

    def fit(self, layout: Any, words: int, offsets: dict[str, int],
            uploader: Uploader | None, pinned: bool) -> None:
        """Size the halves for `layout` (at least `words` int32 words each; a new buffer, in
        page-locked memory when `pinned`, only when the old one is too small, after the copies
        that still read it) and keep its table `offsets`. Called only when the layout object
        changes (the same layout step after step: no sizes)."""
        if not self.halves or self.halves[0].size < words:
            if uploader is not None:  # copies still reading the old buffer finish
                uploader.wait(0)
                uploader.wait(1)
            self.buffer = st = torch.zeros(2 * words, dtype=torch.int32, pin_memory=pinned)
            self.halves = (st[:words].numpy(), st[words:].numpy())
            self.halves_at = (st.data_ptr(), st.data_ptr() + 4 * words)
        self.layout, self.offsets = layout, offsets

    def take(self, uploader: Uploader | None) -> tuple[int, np.ndarray, dict[str, int]]:
        """The half the next plan writes (its index and a numpy view) and the table offsets,
        once the copies that still read that half (those of the plan before last) are done."""
        half = 1 - self.half
        if uploader is not None:
            uploader.wait(half)
        return half, self.halves[half], self.offsets

    def commit(self, half: int, buf: np.ndarray) -> None:
        """Make `buf` (staging half `half`, from `take`) the current plan's words."""
        self.half, self.current = half, buf
