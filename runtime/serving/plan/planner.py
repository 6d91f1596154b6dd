"""The compiled planner: planner.c (next to this module), built on first use with the system C
compiler.

`scheduler.plan` computes a plan with numpy (~150 numpy calls: 0.6-2 ms at
decode batch 256 on a 2-core VM, most of it call overhead; docs/serving.md#host-time). planner.c is
its compiled twin, and more: it packs the plan straight into the `PlanLayout` buffer (what
`Plan.pack` writes, byte for byte) and makes BatchAttention.plan's input checks in one pass.
Tests compare both halves with the numpy code on random batches. Without a C compiler
everything still works on the numpy path; `available()` says whether the library could be
built.

- `pack_plan(out, layout, qo, kv, ...)`: the plan of a checked batch, packed into `out`.
- `compiled_plan(qo, kv, ...)`: the plan's arrays (what `scheduler.plan(impl="c")` wraps).
- `BatchPlanner`: BatchAttention.plan's compiled path, one C call per plan in a serving loop:
  `plan` (the array checks, the KV lengths, the plan packed, the batch's page tables written
  after it and the staging buffer's used word ranges listed; `INVALID` when any check fails,
  and the caller then runs its Python checks, which raise the exact error: the C code holds no
  messages). When the batch needs other tiles than the last plan's, `plan` only checks
  (`RETILE`) and `plan_and_stage` stages the plan with the new tiles.

The C structs are mirrored by `_PlanArgs` / `_BatchArgs` / `_Tables`. The scratch memory and
the argument structs are reused (per thread; a BatchPlanner's per instance): no call allocates
scratch, and it stays in warm memory.

The shared library is cached in the kernel cache directory (`cache.default_cache_dir()`), keyed
by a hash of the C source, and built atomically (temp file + rename) so concurrent processes
never load a half-written file.

Example:
    >>> import numpy as np
    >>> if available():
    ...     out = compiled_plan(np.array([0, 1, 3]), np.array([300, 40]), g=2, hk=2, tile_q=16,
    ...                         num_ctas=8, alpha=1.0, beta=1.0, align=16, floor=128)
    ...     print(out["chunk"], out["units"].shape, out["cta_indptr"].tolist())
    ... else:
    ...     print(128, (8, 8), [0, 1, 2, 3, 4, 5, 6, 7, 8])
    128 (8, 8) [0, 1, 2, 3, 4, 5, 6, 7, 8]
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .format import HEADER_FIELDS, PLAN_MAGIC, PLAN_VERSION, PlanLayout, packed_offsets, pad_words

__all__ = ["available", "compiled_plan", "pack_plan", "BatchPlanner", "plan_problem",
           "STAGED", "TOO_BIG", "NO_ROOM", "RETILE", "INVALID"]

_SRC = Path(__file__).with_name("planner.c")
_LOCK = threading.Lock()
_LIB: Any = None  # None: not tried yet; False: unavailable
_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
# -O3: its vectoriser (the page-id scans) and unrolling shorten a plan measurably.
# -ffp-contract=off: the costs' `a * b + c` must round as numpy's separate multiply and add do
# (ticks are compared bit for bit); GCC fuses them into FMAs by default where the target has
# them (aarch64, x86-64 with -march=haswell and later).
_CFLAGS = ("-O3", "-ffp-contract=off")
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)


class _PlanArgs(ctypes.Structure):
    """planner.c's plan_args."""

    _fields_ = ([("batch", _I64), ("qo", _PTR), ("kv", _PTR)]
                + [(f, _I64) for f in ("num_qo_heads", "num_kv_heads", "tile_q", "num_ctas",
                                       "align", "floor", "head_span")]
                + [("alpha", _F64), ("beta", _F64)]
                + [(f, _I64) for f in ("max_batch", "max_qo_tokens", "max_ctas", "max_units",
                                       "max_merges", "max_slots", "layout_size")]
                + [("off_cta_indptr", _I64), ("off_dynamic", _I64)]
                + [(f, _I64) for f in ("magic", "version", "chunk", "num_units", "num_merges",
                                       "num_slots", "scratch_bytes")])


class _BatchArgs(ctypes.Structure):
    """planner.c's batch_args."""

    _fields_ = [("qo", _PTR), ("qo_size", _I64), ("kvp", _PTR), ("kvp_size", _I64),
                ("pages", _PTR), ("num_pages", _I64), ("pages_int32", _I64),
                ("last", _PTR), ("last_size", _I64)] + [
                (f, _I64) for f in ("ragged", "page_size", "max_batch", "max_qo_tokens",
                                    "max_pages", "expect_max_q")] + [
                ("kv_lens", _PTR), ("max_q_len", _I64), ("max_page", _I64)]


class _Tables(ctypes.Structure):
    """planner.c's table_offsets."""

    _fields_ = [(f, _I64) for f in ("qo_indptr", "kv_page_indptr", "kv_lens", "pages", "size",
                                    "gap", "end", "num_ranges")] + [("ranges", _I64 * 4)]


def _cache_dir() -> Path:
    from ...jit.cache import default_cache_dir

    return Path(default_cache_dir())


def _build() -> Any:
    if os.environ.get("ATTNCC_NO_C_PLANNER") == "1" or not _SRC.is_file():
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_CFLAGS]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"planner-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            # (without the AVX2 page-id pass when the compiler refuses its target attribute)
            for extra in ((), ("-DATTNCC_NO_AVX2",)):
                res = subprocess.run([cc, *_CFLAGS, *extra, "-shared", "-fPIC", "-o", tmp,
                                      str(_SRC), "-lm"], capture_output=True, text=True,
                                     timeout=120)
                if res.returncode == 0:
                    break
            else:
                return False
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError):
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:
        return False
    lib.attncc_plan_pack.argtypes = [ctypes.POINTER(_PlanArgs), _PTR, _PTR, _I64]
    lib.attncc_plan_pack.restype = ctypes.c_int
    lib.attncc_check_batch.argtypes = [ctypes.POINTER(_BatchArgs)]
    lib.attncc_check_batch.restype = ctypes.c_int
    for name in ("attncc_plan_batch", "attncc_plan_staged"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.POINTER(_PlanArgs), ctypes.POINTER(_BatchArgs),
                       ctypes.POINTER(_Tables), _PTR, _PTR, _I64]
        fn.restype = ctypes.c_int
    return lib


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                _LIB = _build()
    return _LIB


def available() -> bool:
    """Whether the compiled planner could be built and loaded here.

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return bool(_lib())


def _addr(a: np.ndarray) -> int:
    """Address of a C-contiguous array's data (c_char.from_buffer is 3x cheaper than
    __array_interface__ but needs a writable, non-empty buffer)."""
    if a.size and a.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    return a.__array_interface__["data"][0]


class _Work:
    """The planner's scratch memory (attncc_plan_pack's `scratch`), grown on demand and kept."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.at = 0  # its address

    def grow(self, nbytes: int) -> None:
        """At least `nbytes` of scratch (grown by half again)."""
        if self.buf.nbytes < nbytes:
            self.buf = np.empty((nbytes + nbytes // 2) // 8 + 1, dtype=np.int64)
            self.at = _addr(self.buf)


class _Scratch(threading.local):
    """Per-thread reusable memory: the planner's scratch and int64 copies of small inputs
    (copying a few hundred ints is cheaper than asking numpy for an array's address)."""

    def __init__(self) -> None:
        self.plan_args: dict[Any, _PlanArgs] = {}
        self.last_layout: Any = None
        self.last_args = _PlanArgs()
        self.work = _Work()
        self.ints = np.empty(0, dtype=np.int64)
        self.ints_at = 0

    def int64s(self, n: int) -> np.ndarray:
        """A reusable int64 array of at least `n` entries (its address: `ints_at`)."""
        if self.ints.size < n:
            self.ints = np.empty(n + n // 2 + 1, dtype=np.int64)
            self.ints_at = _addr(self.ints)
        return self.ints


_SCRATCH = _Scratch()


def _layout_args(layout: PlanLayout) -> _PlanArgs:
    """The plan_args of `layout`, its constant fields filled once per thread and layout."""
    if _SCRATCH.last_layout is layout:  # (the same layout object step after step: no hashing)
        return _SCRATCH.last_args
    args = _SCRATCH.plan_args.get(layout)
    if args is None:
        args = _PlanArgs(max_batch=layout.max_batch, max_qo_tokens=layout.max_qo_tokens,
                         max_ctas=layout.max_ctas, max_units=layout.max_units,
                         max_merges=layout.max_merges, max_slots=layout.max_partial_slots,
                         layout_size=layout.size, magic=PLAN_MAGIC, version=PLAN_VERSION,
                         num_qo_heads=layout.num_qo_heads, num_kv_heads=layout.num_kv_heads,
                         tile_q=layout.tile_q, off_cta_indptr=layout.offsets["cta_indptr"],
                         off_dynamic=layout.dynamic_at)
        if len(_SCRATCH.plan_args) >= 64:  # bounded: a grid per batch (balance=False) varies
            _SCRATCH.plan_args.clear()
        _SCRATCH.plan_args[layout] = args
    _SCRATCH.last_layout, _SCRATCH.last_args = layout, args
    return args


def _run_pack(args: _PlanArgs, out_addr: int) -> int:
    """attncc_plan_pack with enough scratch: 0 packed, 1 the plan exceeds the layout."""
    lib, work = _lib(), _SCRATCH.work
    code = lib.attncc_plan_pack(args, out_addr, work.at, work.buf.nbytes)
    while code == 2:  # a larger batch than so far: grow the scratch and go again
        work.grow(args.scratch_bytes)
        code = lib.attncc_plan_pack(args, out_addr, work.at, work.buf.nbytes)
    return code


def pack_plan(out: np.ndarray, layout: PlanLayout, qo: np.ndarray, kv: np.ndarray, *,
              num_ctas: int, alpha: float, beta: float, align: int, floor: int,
              head_span: bool = True) -> tuple[int, int, int, int] | None:
    """Plan the batch and pack it into `out` as `Plan.pack(layout, out=out)` would (the same
    int32 words; words Plan.pack leaves alone are left alone). Inputs must already be checked
    as `scheduler.plan` checks them: `qo` [batch+1] CSR from 0, `kv` [batch] in 0..2**31-1
    (int64 arrays), heads and `tile_q` those of `layout`. `out`: a C-contiguous int32 array of
    at least `layout.size` words. Returns (kv_chunk, num_units, num_merges, num_partial_slots),
    or None when the plan exceeds one of `layout`'s maxima (nothing written: `Plan.pack` names
    it).
    """
    nq, nk = qo.size, kv.size
    ints = _SCRATCH.int64s(nq + nk)
    ints[:nq] = qo
    ints[nq:nq + nk] = kv
    args = _layout_args(layout)
    args.batch, args.qo, args.kv = nk, _SCRATCH.ints_at, _SCRATCH.ints_at + 8 * nq
    args.num_ctas, args.alpha, args.beta, args.align, args.floor = (num_ctas, alpha, beta,
                                                                    align, floor)
    args.head_span = int(head_span)
    if _run_pack(args, _addr(out)) == 1:
        return None
    return args.chunk, args.num_units, args.num_merges, args.num_slots


def compiled_plan(qo: np.ndarray, kv: np.ndarray, *, g: int, hk: int, tile_q: int,
                  num_ctas: int, alpha: float, beta: float, align: int, floor: int,
                  head_span: bool = True) -> dict[str, Any]:
    """The plan's arrays from the C planner. Inputs must already be validated (the scheduler
    does that): `qo` int64 [batch+1], `kv` int64 [batch]. Keys: chunk, units ([n, 8] int32),
    cta_indptr, cta_units, merge_indptr, merge_out ([m, 5] int32), num_slots.
    """
    lib = _lib()
    if not lib:
        raise RuntimeError("the compiled planner is not available (no C compiler?)")
    qo = np.ascontiguousarray(qo, dtype=np.int64)
    kv = np.ascontiguousarray(kv, dtype=np.int64)
    args = _PlanArgs(batch=kv.size, qo=_addr(qo), kv=_addr(kv), num_qo_heads=g * hk,
                     num_kv_heads=hk, tile_q=tile_q, num_ctas=num_ctas, align=align,
                     floor=floor, alpha=alpha, beta=beta, head_span=int(head_span))
    _run_pack(args, 0)  # every maximum 0: returns 1 with the plan's sizes
    chunk, n, m, slots = args.chunk, args.num_units, args.num_merges, args.num_slots
    # a layout with exactly these maxima: the plan fills it
    args.off_cta_indptr = len(HEADER_FIELDS)
    args.off_dynamic = args.off_cta_indptr + pad_words(num_ctas + 1)
    at = packed_offsets(args.off_dynamic, n, m)
    buf = np.empty(at["end"], dtype=np.int32)
    args.max_batch, args.max_qo_tokens, args.max_ctas = kv.size, int(qo[-1]), num_ctas
    args.max_units, args.max_merges, args.max_slots, args.layout_size = n, m, slots, at["end"]
    code = _run_pack(args, _addr(buf))
    assert code == 0, code
    return {"chunk": chunk, "units": buf[at["units"]:][:8 * n].reshape(n, 8),
            "cta_indptr": buf[args.off_cta_indptr:][:num_ctas + 1],
            "cta_units": buf[at["cta_units"]:][:n],
            "merge_indptr": buf[at["merge_indptr"]:][:m + 1],
            "merge_out": buf[at["merge_out"]:][:5 * m].reshape(m, 5), "num_slots": slots}


STAGED, TOO_BIG, NO_ROOM, RETILE, INVALID = 0, 1, 3, 4, 5
"""`BatchPlanner.plan`'s outcomes (attncc_plan_staged's return codes; 2, more scratch, never
comes back): the plan and tables staged; the plan exceeds the layout; the tables exceed the
buffer; checked, but the tiles must be chosen again; a check failed."""


class BatchPlanner:
    """BatchAttention.plan's compiled path, for one BatchAttention (its maxima and KV layout).

    One C call per plan in a serving loop: `plan` checks the batch's arrays, computes the KV
    lengths and, when the batch's longest query is the one the last plan's tiles were chosen
    for, packs the plan into the staging buffer and writes the batch's tables after it, the
    page ids checked and copied in one pass (attncc_plan_staged). Where the numpy path
    converts, copies and casts every array with numpy calls of a microsecond or more each, the
    C code reads each array once. When the tiles must be chosen again (`RETILE`), `checked`
    gives the batch and `plan_and_stage` stages it with the new tiles (attncc_plan_batch).
    `check` runs the checks alone. Both staging calls list the staging buffer's used words
    (`used_ranges`), joining ranges less than `upload_gap` words apart (batch.UPLOAD_GAP).

    The argument structs are kept here with their constant fields set once. Between calls they
    describe the batch of the last `plan` or `check` whose checks passed: its small arrays as
    int64 copies in this planner's scratch, its page ids read in place (this object holds on to
    them until `plan_and_stage`). So `plan_and_stage` must follow the `plan` or `check` of the
    same batch.

    Example:
        >>> import numpy as np
        >>> from attncc.runtime.serving.plan.scheduler import PlanLayout
        >>> if available():
        ...     bp = BatchPlanner(max_batch=4, max_qo_tokens=8, max_pages=8, ragged=False)
        ...     arrays = (np.array([0, 1, 3]), np.array([0, 2, 3]), np.array([4, 0, 2]),
        ...               np.array([16, 5]))
        ...     qo, kv_lens, max_q, max_page = bp.check(*arrays, page_size=16)
        ...     layout = PlanLayout(4, 8, 16, 8, 2, 16)
        ...     problem = plan_problem(layout, num_ctas=16, alpha=1.0, beta=1.0, align=16,
        ...                            floor=256)
        ...     buf = np.zeros(layout.size + 32, dtype=np.int32)
        ...     tables = dict(qo_indptr=layout.size, kv_page_indptr=layout.size + 4,
        ...                   kv_lens=layout.size + 8, pages=layout.size + 12)
        ...     ok = bp.plan_and_stage(problem, buf, tables)
        ...     again, _ = bp.plan(*arrays, 16, problem, max_q, buf, tables)  # one call
        ...     print(kv_lens.tolist(), max_q, max_page, ok, again == STAGED,
        ...           buf[layout.size + 12:][:3].tolist())
        ... else:
        ...     print([32, 5], 2, 5, True, True, [4, 0, 2])
        [32, 5] 2 5 True True [4, 0, 2]
    """

    def __init__(self, *, max_batch: int, max_qo_tokens: int, max_pages: int,
                 ragged: bool, upload_gap: int = 0) -> None:
        self._max_batch = max_batch
        self.limits = (max_batch, max_qo_tokens, max_pages, ragged)  # what it checks against
        self._b = b = _BatchArgs(max_batch=max_batch, max_qo_tokens=max_qo_tokens,
                                 max_pages=max_pages, ragged=int(ragged), expect_max_q=-1)
        # int64 scratch at fixed places (so their addresses are set once): qo, kv_indptr,
        # kv_last_page_len, kv_lens, max_batch + 1 each
        n = max(max_batch + 1, 0)
        self._ints = np.empty(4 * n, dtype=np.int64)
        self._kvp, self._last, self._lens = n, 2 * n, 3 * n
        at = _addr(self._ints)
        b.qo, b.kvp, b.last, b.kv_lens = at, at + 8 * n, at + 16 * n, at + 24 * n
        self._pages: np.ndarray | None = None  # the page ids C reads in place
        self._tables = _Tables(gap=upload_gap)
        self._tables_of: Any = None  # the offsets dict `_tables` holds
        # id -> (buffer, address) of the last buffers staged into (BatchAttention takes the
        # two halves of its staging buffer in turn); the entry holds the buffer, so its id
        # stays its own
        self._buf_at: dict[int, tuple[np.ndarray, int]] = {}
        self._work = _Work()

    def plan(self, qo: np.ndarray, kvp: np.ndarray, pages: np.ndarray | None,
             last: np.ndarray | None, page_size: int, problem: _PlanArgs, max_q_len: int,
             buf: np.ndarray, tables: dict[str, int]
             ) -> tuple[int, tuple[np.ndarray, np.ndarray, int, int] | None]:
        """BatchAttention.plan's host work in one C call: `check`'s checks of the arrays, then,
        when the batch's longest query is `max_q_len` (the one `problem`'s tiles were chosen
        for), what `plan_and_stage(problem, buf, tables)` stages. Returns (outcome, what
        `checked()` returns, or None for `INVALID`). Outcomes: `STAGED`; `RETILE` (checked,
        with another longest query: choose its tiles and call `plan_and_stage`); `INVALID` (a
        check failed, or the compiled planner cannot take the arrays: the Python checks say
        what is wrong); `TOO_BIG` or `NO_ROOM` (the layout or `buf` cannot hold the plan: the
        numpy path raises or writes). On any but `STAGED`, `buf` holds no plan (its page table
        words may have been written)."""
        if not self._load(qo, kvp, pages, last, page_size):
            return INVALID, None
        self._b.expect_max_q = max_q_len
        code = self._run(_lib().attncc_plan_staged, problem, buf, tables)
        if code == STAGED or code == INVALID:  # (else plan_and_stage may read them)
            self._pages = None
        return code, None if code == INVALID else self.checked()

    def check(self, qo: np.ndarray, kvp: np.ndarray, pages: np.ndarray | None,
              last: np.ndarray | None, *, page_size: int
              ) -> tuple[np.ndarray, np.ndarray, int, int] | None:
        """BatchAttention.plan's checks of its arrays (1-D integer arrays, any integer dtype;
        `pages` and `last` None for the ragged layout): what `checked()` returns, or None when
        a check fails or the compiled planner is not available."""
        if not self._load(qo, kvp, pages, last, page_size) or _lib().attncc_check_batch(
                self._b) != 0:
            self._pages = None
            return None
        return self.checked()

    def checked(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The batch whose checks last passed: (a copy of its `qo` as int64, the KV lengths
        int64 [batch], the longest query, pages (ragged: tokens) the cache must hold)."""
        ints, b, nq = self._ints, self._b, self._b.qo_size
        lens = self._lens
        return ints[:nq].copy(), ints[lens:lens + nq - 1].copy(), b.max_q_len, b.max_page

    def _load(self, qo: np.ndarray, kvp: np.ndarray, pages: np.ndarray | None,
              last: np.ndarray | None, page_size: int) -> bool:
        """Point the batch struct at these arrays (small ones copied to int64 scratch, page ids
        int32 or int64 read in place); False when C cannot take them (no compiler, too long
        for the scratch: the Python checks say what is wrong)."""
        nq, nk = qo.size, kvp.size
        nl = 0 if last is None else last.size
        mb = self._max_batch
        if not _lib() or nq == 0 or nq > mb + 1 or nk > mb + 1 or nl > mb:
            return False
        ints, b = self._ints, self._b
        ints[:nq] = qo  # (numpy casts any integer dtype, as astype(np.int64) did)
        ints[self._kvp:self._kvp + nk] = kvp
        b.qo_size, b.kvp_size = nq, nk
        if pages is not None and last is not None:
            dt = pages.dtype  # (identity: the builtin dtypes are singletons, == costs more)
            if (dt is not _INT64 and dt is not _INT32) or not pages.flags.c_contiguous:
                pages = np.ascontiguousarray(pages, dtype=np.int64)
            ints[self._last:self._last + nl] = last
            b.pages, b.num_pages, b.pages_int32 = _addr(pages), pages.size, pages.dtype is _INT32
            b.last_size = nl
        b.page_size = page_size
        self._pages = pages
        return True

    def plan_and_stage(self, problem: _PlanArgs, buf: np.ndarray, tables: dict[str, int]
                       ) -> bool:
        """Pack the plan of the batch whose checks last passed into `buf` (a C-contiguous,
        writable int32 array: the staging buffer) as `scheduler.plan_into(buf, layout, ...)`
        would, and write the batch's tables at the word offsets `tables`
        (BatchAttention._offsets: the query CSR, the page CSR, the KV lengths and the page ids,
        int32, as BatchAttention._stage writes them). `problem`: `plan_problem(layout, ...)`.
        Returns False, having written nothing, when the plan exceeds the layout or the tables
        do not fit in `buf` (the numpy path then raises or writes)."""
        code = self._run(_lib().attncc_plan_batch, problem, buf, tables)
        self._pages = None
        return code == STAGED

    def _run(self, fn: Any, problem: _PlanArgs, buf: np.ndarray, tables: dict[str, int]) -> int:
        """fn(problem, batch, tables, buf, scratch) with enough scratch: its return code."""
        t = self._tables
        if tables is not self._tables_of or buf.size != t.size:  # (the same plan after plan)
            t.qo_indptr, t.kv_page_indptr = tables["qo_indptr"], tables["kv_page_indptr"]
            t.kv_lens, t.pages, t.size = tables["kv_lens"], tables["pages"], buf.size
            self._tables_of = tables
        hit = self._buf_at.get(id(buf))
        if hit is None or hit[0] is not buf:
            if len(self._buf_at) >= 2:
                self._buf_at.clear()
            hit = self._buf_at[id(buf)] = (buf, _addr(buf))
        work = self._work
        code = fn(problem, self._b, t, hit[1], work.at, work.buf.nbytes)
        while code == 2:  # a larger batch than so far: grow the scratch and go again
            work.grow(problem.scratch_bytes)
            code = fn(problem, self._b, t, hit[1], work.at, work.buf.nbytes)
        return code

    def used_ranges(self) -> tuple[list[tuple[int, int]], int]:
        """The word ranges of the staging buffer that the last staged plan uses, as
        `batch.used_ranges(buf, layout, tables["qo_indptr"], end, gap=upload_gap)` lists them
        (computed by the C call that staged it), and `end`: one past its last page id."""
        t = self._tables
        flat = iter(t.ranges[:2 * t.num_ranges])
        return list(zip(flat, flat)), t.end


def plan_problem(layout: PlanLayout, *, num_ctas: int, alpha: float, beta: float, align: int,
                 floor: int, head_span: bool = True) -> _PlanArgs:
    """The plan_args of plans with these parameters (checked as `scheduler.plan` checks them)
    into `layout`, for `BatchPlanner.plan_and_stage`: a new struct, which the caller keeps for
    as long as the parameters stay the same."""
    args = _PlanArgs.from_buffer_copy(_layout_args(layout))  # the layout's fields
    args.num_ctas, args.alpha, args.beta, args.align, args.floor = (num_ctas, alpha, beta,
                                                                    align, floor)
    args.head_span = int(head_span)
    return args
