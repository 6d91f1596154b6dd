"""Serving attention: ragged query batches over paged or ragged KV caches, planned then run.

`BatchAttention(variant, workspace_buffer, kv_layout=...)` follows FlashInfer's plan/run split:

- `plan(...)` (host, once per generation step) turns the batch's lengths into a load-balanced
  plan (`scheduler.plan`: work units of (request, KV head, query tile, KV chunk)
  assigned longest-first to a fixed grid of CTAs, plus the merge map of split KV ranges), packs
  it with the batch's page tables into a pinned host buffer (two halves that plans take in
  turn) and copies the words in use to the workspace: the plan (one range, its sections back
  to back) and the page tables (at fixed offsets after the plan's room), one or two
  asynchronous copies.
- `run(q, kv_cache)` launches the persistent FA2 (or FA3) kernel over the plan and the merge kernel
  of its split items (kernels/fa2/fa2_batch.cuh). On sm_90 the merge kernel is a programmatic dependent
  launch: its launch and its reads of the plan overlap the attention kernel's last units, and it
  waits (griddepcontrol.wait) only before the partial states. Every pointer and both grid sizes are
  fixed by the workspace, so `run` can be captured once in a CUDA graph and replayed after new
  `plan` calls.

Layouts (FlashInfer's names): `q`, `out` are `[total_q_tokens, num_qo_heads, head_dim]` with request
i owning tokens `qo_indptr[i] .. qo_indptr[i+1]`. KV caches:

- "NHD": `(k_cache, v_cache)` each `[num_pages, page_size, num_kv_heads, head_dim]`, or one tensor
  `[num_pages, 2, page_size, num_kv_heads, head_dim]`;
- "HND": the same with `[num_pages, num_kv_heads, page_size, head_dim]` pages;
- "ragged": `(k, v)` each `[total_kv_tokens, num_kv_heads, head_dim]`, request i owning tokens
  `kv_indptr[i] .. kv_indptr[i+1]` (no pages).

Request i's queries are the LAST `l_q` tokens of its sequence: its query t is position
`kv_len - l_q + t`, which the variant's hooks see as `q_idx` (so `q_idx >= kv_idx` is causal for
prefill chunks and decode steps alike).

Example (CPU: the plan and its checks; `run` needs a CUDA GPU):
    >>> import torch
    >>> ba = BatchAttention(None, kv_layout="NHD", device="cpu")
    >>> ba.plan(torch.tensor([0, 1, 3]), torch.tensor([0, 2, 3]), torch.tensor([4, 0, 2]),
    ...         torch.tensor([16, 5]), num_qo_heads=8, num_kv_heads=2, head_dim=128,
    ...         page_size=16)
    >>> ba.kv_lens.tolist(), ba.tiles.tq
    ([32, 5], 16)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from attncc.codegen import constants
from attncc.errors import DeviceError, check_bool, check_int
from attncc.frontend import Variant
from attncc.ir.analysis import Shapes
from attncc.ir.program import Bindings, VariantIR

from ..jit.device import num_sms
from ..jit.launch_args import captured, clamped
from ..jit.launcher import driver, driver_check
from ..jit.policy import compile_fa3, spill_bytes
from ..jit.sources import fa2_source
from ..jit.tiles import HEAD_DIMS, LaunchConfig, fa2_config
from .fa3_batch import fa3_batch_maps, fa3_batch_source, fa3_batch_tiles, fa3_unsupported
from .plan import planner, scheduler
from .plan.checks import KV_LAYOUTS, RAGGED_PAGE, CheckedBatch, check_batch, int_array, page_shift
from .plan.lpt import lpt_schedule

__all__ = ["BatchAttention", "BatchTiles", "clip_causal_units", "KV_LAYOUTS"]

_INT = np.int32
MERGE_THREADS = constants.MERGE_THREADS  # the batch kernels' NAME_merge block size


@dataclass(frozen=True)
class BatchTiles:
    """The FA2 configuration of a plan: fused query rows per tile, KV rows per tile, pipeline
    depth, 16-row MMA fragments per warp, the persistent grid, and (decode) the warps that split
    each KV tile."""

    tq: int
    tkv: int
    stages: int
    m_frags: int
    ctas_per_sm: int
    num_ctas: int
    kv_warps: int = 1
    kernel: str = "fa2"  # "fa3": kernels/fa3/fa3_batch.cuh (sm_90; runtime/serving/fa3_batch.py)


def choose_batch_tiles(head_dim: int, max_fused_rows: int, num_sms: int,
                       force: tuple[int, ...] | None = None, fa3: str = "off") -> BatchTiles:
    """Tiles for a batch whose longest request has `max_fused_rows` (query tokens x GQA group);
    `force=(T_q, T_kv, stages[, kv_warps])` takes those instead (the grid still follows
    residency). `fa3` ("off", "auto", "on"; the caller checked the FA3 batch kernel can run the
    batch, fa3_batch.py): "on" takes the FA3 batch kernel's tiles (128 fused rows x 128
    keys, one CTA per SM), "auto" does so for prefill batches (at least 128 fused rows).

    Decode (up to 16 fused rows) gets 16-row tiles with 2 warps splitting each 32-row KV tile:
    the memory-bound case wants many loads in flight per SM, and a 16-row tile alone is one
    warp (docs/serving.md#decode). Larger tiles are FA2's, with the
    prefill kernel's 128-row tiles at D <= 128.

    Example:
        >>> choose_batch_tiles(128, 8, 132)
        BatchTiles(tq=16, tkv=32, stages=2, m_frags=1, ctas_per_sm=6, num_ctas=792, kv_warps=2, kernel='fa2')
        >>> choose_batch_tiles(128, 4096, 132).tq
        128
        >>> choose_batch_tiles(128, 4096, 132, fa3="auto")
        BatchTiles(tq=128, tkv=128, stages=3, m_frags=1, ctas_per_sm=1, num_ctas=132, kv_warps=1, kernel='fa3')
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the batch kernel supports {HEAD_DIMS}")
    if fa3 == "on" or (fa3 == "auto" and force is None and max_fused_rows >= 128):
        t = fa3_batch_tiles(head_dim)
        return BatchTiles(t.tq, t.tkv, t.stages, 1, 1, num_sms, 1, "fa3")
    tq = next((t for t in (16, 32, 64) if t >= max_fused_rows), 128 if head_dim <= 128 else 64)
    # small tiles are bandwidth-bound: 32-row KV tiles halve the shared memory per CTA so twice
    # as many CTAs (and their loads) are in flight per SM
    tkv = 32 if head_dim == 256 or tq <= 32 else 64
    stages, kv_warps = 2, 1
    if tq == 16:
        kv_warps = 2
    if force is not None:
        tq, tkv, stages = force[:3]
        kv_warps = force[3] if len(force) > 3 else 1
    m_frags = 2 if tq == 128 and head_dim <= 128 else 1
    cfg = fa2_config(head_dim, tq, tkv, stages, m_frags, kv_warps)
    # residency: 64K registers and 227 KB of shared memory per SM, with registers per thread as
    # the kernel's __launch_bounds__ caps them (fa2_config.cuh's kMinBlocks: decode CTAs fit 128
    # registers per thread, the others may take 255)
    by_regs = 65536 // (cfg.threads * (128 if kv_warps > 1 else 256))
    by_smem = (227 * 1024) // cfg.smem_bytes
    per_sm = max(1, min(by_regs, by_smem, 16))
    return BatchTiles(tq, tkv, stages, m_frags, per_sm, per_sm * num_sms, kv_warps)


def _is_int(x: Any) -> bool:
    """Whether `x` is an int or a numpy integer (not a bool)."""
    return type(x) is int or (isinstance(x, (int, np.integer)) and not isinstance(x, bool))


def _plain_scalars(num_qo_heads: Any, num_kv_heads: Any, head_dim: Any, page_size: Any,
                   ragged: bool, kv_indices: Any, kv_last_page_len: Any) -> bool:
    """Whether plan()'s scalar arguments are what the compiled path takes as they are: int
    heads that divide, a supported head dim, a positive int page size (paged layouts), and the
    layout's arrays given (paged) or left out (ragged). Anything else goes to the reference
    checks, which raise (or convert) as they always have."""
    if type(num_qo_heads) is not int or type(num_kv_heads) is not int \
            or type(head_dim) is not int:  # (the cheap test first: plan() runs every step)
        if not (_is_int(num_qo_heads) and _is_int(num_kv_heads) and _is_int(head_dim)):
            return False
    return (num_kv_heads > 0 and num_qo_heads % num_kv_heads == 0 and head_dim in HEAD_DIMS
            and (ragged or (isinstance(page_size, int) and page_size >= 1))
            and (kv_indices is None) == ragged and (kv_last_page_len is None) == ragged)


@functools.lru_cache(maxsize=256)
def _batch_tiles(head_dim: int, max_fused_rows: int, num_sms: int,
                 force: tuple[int, ...] | None, fa3: str) -> BatchTiles:
    """`choose_batch_tiles`, memoised: plan() runs every generation step."""
    return choose_batch_tiles(head_dim, max_fused_rows, num_sms, force, fa3)


@functools.lru_cache(maxsize=64)
def _plan_layout(max_batch: int, max_qo_tokens: int, num_ctas: int, num_qo_heads: int,
                 num_kv_heads: int, tile_q: int) -> scheduler.PlanLayout:
    """`scheduler.PlanLayout(...)`, memoised: plan() needs the same few every step."""
    return scheduler.PlanLayout(max_batch, max_qo_tokens, num_ctas, num_qo_heads, num_kv_heads,
                                tile_q)


@dataclass(frozen=True, slots=True)
class _Config:
    """What a plan's schedule depends on besides the batch: the tiles, the packed layout, the
    scheduler's keyword arguments, and (compiled planner) its C arguments for them."""

    tiles: BatchTiles
    layout: scheduler.PlanLayout
    kwargs: dict            # scheduler.plan's kv_chunk_align / min_kv_chunk / head_span
    problem: Any = None     # planner.plan_problem(...) when the compiled planner is in use


_Staged = tuple[_Config, int, np.ndarray, dict, bool]
"""A staged plan: its config, the staging half, that half's numpy view, the table offsets, and
whether planner.c staged it (and so listed the used words)."""


class _LazyPlan:
    """The `scheduler.Plan` a `BatchAttention.plan` packed, computed on first attribute access.

    plan() packs straight into the staging buffer and never needs the typed arrays; inspection
    and tests do (`ba._plan.num_merges`). Same arguments, so the same plan (the packed words of
    the compiled planner and of scheduler.plan are tested to agree word for word)."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self._args, self._kwargs = args, kwargs
        self._plan: scheduler.Plan | None = None  # the typed plan, computed when looked at

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not a Plan field (and no recursion before __init__ ran)
            raise AttributeError(name)
        if self._plan is None:
            self._plan = scheduler.plan(*self._args, **self._kwargs)
        return getattr(self._plan, name)


class _Kernels:
    """The compiled batch kernel and its merge kernel for one (variant, head dim, dtype, tiles)."""

    def __init__(self, ir: VariantIR, head_dim: int, dtype: str, tiles: BatchTiles,
                 device: int) -> None:
        from attncc.ir.simplify import simplify_variant

        from ..jit.cache import cached_compile
        from ..jit.launcher import load_kernel
        from ..jit.nvrtc import device_arch

        with torch.cuda.device(device):
            arch = device_arch()
        self.ir = simplify_variant(ir)
        if tiles.kernel == "fa3":
            gk = fa3_batch_source(self.ir, head_dim, dtype)
            src, name = gk.source, gk.kernel_name
            vp_layout, bp_layout = gk.params_layout, gk.attention_params_layout
            self.config = LaunchConfig(head_dim, tiles.tq, tiles.tkv, tiles.stages, 1,
                                    gk.threads // 32, gk.threads, gk.shared_mem_bytes)
        else:
            self.config = fa2_config(head_dim, tiles.tq, tiles.tkv, tiles.stages, tiles.m_frags,
                                     tiles.kv_warps)
            src, name, vp_layout, bp_layout = fa2_source(
                self.ir, head_dim=head_dim, dtype=dtype, tq=tiles.tq, tkv=tiles.tkv,
                stages=tiles.stages, m_frags=tiles.m_frags, batch=True, kv_warps=tiles.kv_warps)
        if tiles.kernel == "fa3":
            res, _ = compile_fa3(src, arch=arch, name=f"{name}.cu")
        else:
            res, _ = cached_compile(src, arch=arch, name=f"{name}.cu", verbose=True)
        self.spill_bytes = spill_bytes(res.log)
        self.attend = load_kernel(res.cubin, name, bp_layout, vp_layout, device=device,
                                  dynamic_smem=self.config.smem_bytes)
        self.merge = load_kernel(res.cubin, name + "_merge", bp_layout, vp_layout,
                                 device=device)


_KERNELS: dict[tuple, _Kernels] = {}
_KERNELS_LOCK = threading.Lock()


def _kernels_for(ir: VariantIR, head_dim: int, dtype: str, tiles: BatchTiles,
                 device: int) -> _Kernels:
    key = (tuple((n, h.expr) for n, h in ir.hooks.items()), ir.normalize, ir.name, ir.scalars,
           ir.tensors, head_dim, dtype, tiles.tq, tiles.tkv, tiles.stages, tiles.m_frags,
           tiles.kv_warps, tiles.kernel, device)
    with _KERNELS_LOCK:
        hit = _KERNELS.get(key)
        if hit is None:
            hit = _KERNELS[key] = _Kernels(ir, head_dim, dtype, tiles, device)
        return hit


class _Uploader:
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
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (CUDA builds of torch)
        self.raw_stream = raw or (lambda i: self.current_stream(i).cuda_stream)
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


def _check_device(device: Any) -> None:
    """A CUDA device for BatchAttention needs torch to see a GPU: say so, and what runs
    without one, instead of torch's assertion deep inside the constructor."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("BatchAttention(device='cuda') needs a CUDA GPU, and torch sees none "
                          "here (torch.cuda.is_available() is False). Without a GPU: "
                          "attncc.runtime.reference.batch_attention_reference(q, kv_cache, "
                          "qo_indptr, kv_indptr, kv_indices, kv_last_page_len, ...) computes "
                          "the exact result on the CPU, and BatchAttention(..., device='cpu') "
                          "plans without running")


class BatchAttention:
    """Plan/run attention for a serving batch (see the module docstring).

    `variant`: an `attncc.Variant` (None: plain softmax attention). `workspace_buffer`: a uint8
    CUDA tensor the plan, page tables and split-KV partial states live in (None: allocated at the
    first `plan`); `workspace_bytes()` says how large it must be. The maxima bound every later
    plan (and so the workspace): `max_batch` requests, `max_qo_tokens` query tokens, `max_pages`
    page ids per batch. `balance=False` is the no-scheduler ablation: one CTA per (request,
    KV head, query tile), no KV splitting. Tuning knobs (benchmarks): `tiles=(T_q, T_kv, stages[,
    kv_warps])` overrides the heuristic's tiles, `min_kv_chunk` is the scheduler's smallest KV
    chunk (fewer, longer units: fewer pipeline restarts and partial states; default 128
    tokens). `kernel`: None picks the FA3 batch kernel (TMA + wgmma,
    kernels/fa3/fa3_batch.cuh) for prefill batches it can run on an sm_90 GPU and FA2 otherwise;
    "fa2" or "fa3" forces one (a batch "fa3" cannot run raises at plan, saying why).
    """

    def __init__(self, variant: Variant | None = None, workspace_buffer: torch.Tensor | None = None,
                 kv_layout: str = "NHD", *, max_batch: int = 256, max_qo_tokens: int = 16384,
                 max_pages: int = 1 << 20, balance: bool = True,
                 tiles: tuple[int, ...] | None = None, min_kv_chunk: int | None = None,
                 kernel: str | None = None, device: Any = "cuda") -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r}: use one of {KV_LAYOUTS}")
        if kernel not in (None, "fa2", "fa3"):
            raise ValueError(f"kernel={kernel!r}: use None (automatic), 'fa2' or 'fa3'")
        if variant is not None and not isinstance(variant, Variant):
            raise TypeError(f"variant must be an attncc.Variant or None, got "
                            f"{type(variant).__name__}")
        max_batch = check_int("max_batch", max_batch, 1)
        max_qo_tokens = check_int("max_qo_tokens", max_qo_tokens, 1)
        max_pages = check_int("max_pages", max_pages, 1)
        balance = check_bool("balance", balance)
        if min_kv_chunk is not None:
            check_int("min_kv_chunk", min_kv_chunk, 1, "pass a number of KV tokens, e.g. 128")
        _check_device(device)
        self.variant = variant if variant is not None else Variant(name="batch_plain")
        self.kv_layout = kv_layout
        self.max_batch, self.max_qo_tokens, self.max_pages = max_batch, max_qo_tokens, max_pages
        self.balance = balance
        self._forced_tiles = tiles
        self.kernel = kernel
        self._ir: VariantIR | None = None  # _variant_ir's memo
        self._reads_cache: dict[tuple, tuple] = {}  # _safe_reads' memo
        self._kv_bound: int | None | bool = False  # _causal_bound's memo (False: not yet)
        self._fa3_why: dict[tuple, str | None] = {}  # _fa3_mode's memo of fa3_unsupported
        self.min_kv_chunk = None if min_kv_chunk is None else int(min_kv_chunk)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.workspace = workspace_buffer
        self.tiles: BatchTiles | None = None
        self.layout: scheduler.PlanLayout | None = None
        # Staging: one pinned buffer in two halves that plans take in turn, so a plan waits
        # only for the copy of the plan before last (long done in a serving loop), never for
        # the copy the last plan just issued (_staging_for)
        self._staging: torch.Tensor | None = None  # both halves
        self._halves: tuple[np.ndarray, ...] = ()  # numpy views of the two halves
        self._halves_at: tuple[int, ...] = ()  # and their addresses
        self._half = 1  # the half the current plan staged (the next plan takes the other)
        self._staging_np = np.zeros(0, dtype=np.int32)  # the current plan's half
        self._staging_layout: scheduler.PlanLayout | None = None  # and its table offsets:
        self._staging_offsets: dict[str, int] = {}  # _staging_for's memo
        self._offsets: dict[str, int] = {}  # word offsets of the current plan's page tables
        self._uploader: _Uploader | None = None  # copies and their events (the first upload)
        self._ws_checked: tuple = (None, None, 0, 0)  # _workspace_for's memo
        self._plan: _LazyPlan | None = None  # the typed plan, computed when looked at
        self._planner: planner.BatchPlanner | None | bool = None  # None: not made yet
        # _config's memo: (_config_key, longest query, _Config) of the last config
        self._last_config: tuple[tuple, int, _Config] | None = None
        # launch the merge kernel with programmatic dependent launch (sm_90+): its launch and
        # plan prologue overlap the attention kernel's tail (kernels/common/batch_params.cuh)
        self._pdl = True

    # ------------------------------------------------------------------------------ plan
    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any = None,
             kv_last_page_len: Any = None, *, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int = 1, q_positions: Any = None,
             kv_position_offset: Any = None,
             q_data_type: torch.dtype = torch.bfloat16) -> None:
        """Schedule one batch. Paged layouts: `kv_indptr` is the CSR of page ids `kv_indices`
        per request and `kv_last_page_len` the tokens used in each request's last page;
        "ragged": `kv_indptr` is the CSR of KV tokens (no indices, no page size). Host-side
        arrays (CPU tensors, numpy, lists); invalid input raises here, naming the argument.

        Positions the hooks see: by default query token t of request i is position
        `kv_len_i - q_len_i + t` and KV token j is position j. `q_positions` ([total query
        tokens]) overrides the first and `kv_position_offset` ([batch]) shifts the second --
        what CascadeAttention uses for a shared prefix and the suffixes after it.
        `q_data_type` is the dtype `run` will get.

        Host time: with the compiled planner (plan/planner.c) a plan whose tiles are the
        last plan's (a serving loop's every step) is one C call,
        `planner.BatchPlanner.plan`: it checks the arrays, computes the plan straight into the
        pinned staging buffer, writes the page tables after it and lists the used words; other
        plans check first and stage after choosing their tiles (`BatchPlanner.plan_and_stage`).
        On CUDA then one or two async copies of the used words and an event record
        (`_upload`).
        bench/plan_time.py measures it (`--phases`: step by step). Without a C compiler the
        same words come from numpy (`scheduler.plan_into` and `_stage`).
        """
        b, staged = None, None
        if q_positions is None and kv_position_offset is None:
            b, staged = self._checked_fast(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                           num_qo_heads, num_kv_heads, head_dim, page_size,
                                           q_data_type)
        fast = b is not None
        if b is None:
            b = self._checked(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                              num_kv_heads, head_dim, page_size, q_positions, kv_position_offset)
        if staged is None:
            staged = self._stage_plan(b, fast, num_qo_heads, num_kv_heads, head_dim,
                                      q_data_type)
        cfg, half, buf, offsets, c_staged = staged
        tiles, layout = cfg.tiles, cfg.layout
        bound = self._causal_bound() if b.max_q_len > 1 else None
        if bound is not None:
            clip_causal_units(buf, layout, b.qo, b.kv_lens, num_qo_heads // num_kv_heads, bound,
                              b.qpos, b.kvoff, self._section_tokens(tiles, head_dim, q_data_type))
        # (only now: a plan() that raised leaves the last plan's layout and offsets for run())
        self.tiles, self.layout, self._offsets = tiles, layout, offsets
        self._half, self._staging_np = half, buf
        self._plan = _LazyPlan((b.qo, b.kv_lens, num_qo_heads, num_kv_heads, tiles.tq,
                                tiles.num_ctas), cfg.kwargs)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.page_shift, self._max_page = b.page, b.shift, b.max_page
        self.qo_indptr, self.kv_lens = b.qo, b.kv_lens
        self._has_kv_pos, self._has_q_pos = b.kvoff is not None, b.qpos is not None
        if self.device.type == "cuda":
            if c_staged:  # planner.c listed the used words
                self._upload(*self._planner.used_ranges()[::-1])
            else:
                self._upload(offsets["pages"] + int(b.page_indptr[-1]))

    def _checked_fast(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any,
                      kv_last_page_len: Any, num_qo_heads: Any, num_kv_heads: Any,
                      head_dim: Any, page_size: Any, q_dtype: Any
                      ) -> tuple[CheckedBatch | None, _Staged | None]:
        """The batch checked by the compiled planner in one pass and, when it needs the last
        plan's tiles, staged by the same C call: (batch, what `_stage_plan` returns); (batch,
        None) when the batch is checked but not staged (other tiles, or a plan its layout
        cannot hold); (None, None) when the compiled planner cannot vouch for the batch (no C
        compiler, an unusual argument, a failed check): `_checked` then runs the reference
        checks, which raise naming the argument. Never raises itself, so which error a bad
        call gets does not depend on the path."""
        ragged = self.kv_layout == "ragged"
        if not _plain_scalars(num_qo_heads, num_kv_heads, head_dim, page_size, ragged,
                              kv_indices, kv_last_page_len):
            return None, None
        page = RAGGED_PAGE if ragged else page_size
        memo, bp = self._last_config, self._planner
        if memo is None or memo[0] != self._config_key(num_qo_heads, num_kv_heads, head_dim,
                                                       page, q_dtype):
            memo = None  # (a hit vouches for the planner too: the key holds it and its limits)
            if bp is None or (bp and bp.limits != (self.max_batch, self.max_qo_tokens,
                                                   self.max_pages, ragged)):
                bp = self._make_planner()  # the first plan (or maxima changed since)
        if not bp:
            return None, None
        try:
            qo = int_array(qo_indptr, "qo_indptr")
            kvp = int_array(kv_indptr, "kv_indptr")
            pages = None if ragged else int_array(kv_indices, "kv_indices")
            last = None if ragged else int_array(kv_last_page_len, "kv_last_page_len")
        except ValueError:
            return None, None
        ps = 1 if ragged else page_size
        staged = None
        if memo is not None:  # the last plan's tiles, if the batch's longest query is the same
            cfg = memo[2]
            half, buf, offsets = self._staging_for(cfg.layout)
            code, checked = bp.plan(qo, kvp, pages, last, ps, cfg.problem, memo[1], buf,
                                    offsets)
            if code == planner.STAGED:
                staged = (cfg, half, buf, offsets, True)
        else:
            checked = bp.check(qo, kvp, pages, last, page_size=ps)
        if checked is None:
            return None, None
        qo, kv_lens, max_q_len, max_page = checked
        if ragged:  # one "page" per request: its first token
            return CheckedBatch(qo, kv_lens, np.arange(qo.size), kvp[:-1], RAGGED_PAGE, 30,
                                max_page, max_q_len), staged
        return CheckedBatch(qo, kv_lens, kvp, pages, page_size, page_shift(page_size), max_page,
                            max_q_len), staged

    def _stage_plan(self, b: CheckedBatch, fast: bool, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, q_dtype: Any) -> _Staged:
        """Batch `b`'s config, and its plan and tables written to the next staging half: by the
        compiled planner when its checks passed `b` (`fast`), else -- or when the layout cannot
        hold the plan -- with numpy (the same words, or the error scheduler.plan raises).
        Returns (config, staging half, its numpy view, table offsets, whether planner.c
        staged it)."""
        cfg = self._config(b, num_qo_heads, num_kv_heads, head_dim, q_dtype)
        tiles, layout = cfg.tiles, cfg.layout
        half, buf, offsets = self._staging_for(layout)
        if fast and self._planner.plan_and_stage(cfg.problem, buf, offsets):
            return cfg, half, buf, offsets, True
        scheduler.plan_into(buf[:layout.size], layout, b.qo, b.kv_lens, num_qo_heads,
                            num_kv_heads, tiles.tq, tiles.num_ctas, **cfg.kwargs, checked=fast)
        self._stage(buf, b, offsets)
        return cfg, half, buf, offsets, False

    def _checked(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 q_positions: Any, kv_position_offset: Any) -> CheckedBatch:
        """`plan`'s reference checks (`check_batch` with this instance's layout and maxima)."""
        return check_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                           kv_layout=self.kv_layout, num_qo_heads=num_qo_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                           q_positions=q_positions, kv_position_offset=kv_position_offset,
                           max_batch=self.max_batch, max_qo_tokens=self.max_qo_tokens,
                           max_pages=self.max_pages)

    def _make_planner(self) -> planner.BatchPlanner | bool:
        """plan()'s compiled planner, False without a C compiler (made at the first plan that
        can use it, kept after)."""
        self._planner = planner.available() and planner.BatchPlanner(
            max_batch=self.max_batch, max_qo_tokens=self.max_qo_tokens,
            max_pages=self.max_pages, ragged=self.kv_layout == "ragged", upload_gap=UPLOAD_GAP)
        return self._planner

    def _safe_reads(self, ir: VariantIR, bindings: Bindings) -> tuple[VariantIR, Bindings]:
        """The variant with its captured reads that the plan's positions do not prove inside
        their tensors clamped (docs/semantics.md), and the bindings with the clamps' sizes.
        Positions: b < requests, q_idx and kv_idx < the longest KV length; with explicit
        q_positions / kv_position_offset every read is clamped. Serving never raises here (a
        position the box holds may not be in this step's batch): what would be an error in
        flex_attention is clamped. Cached per plan shape, tensor shapes and scalar values; a
        CUDA graph replays the kernel and sizes of the run it captured."""
        if not ir.tensors:
            return ir, bindings
        tensors = {t.name: bindings.tensors.get(t.name) for t in ir.tensors}
        kv = int(self.kv_lens.max()) if len(self.kv_lens) else 0
        try:
            key = (id(ir), len(self.kv_lens), kv, self._has_q_pos or self._has_kv_pos,
                   self.num_qo_heads, self.num_kv_heads, self.head_dim,
                   tuple((n, tuple(t.shape)) for n, t in tensors.items()
                         if isinstance(t, torch.Tensor)),
                   tuple(sorted(bindings.scalars.items())))
            hit = self._reads_cache.get(key)
        except TypeError:
            key, hit = None, None
        if hit is None or hit[0] is not ir:
            hit = (ir, *_serving_clamps(ir, tensors, bindings.scalars, key[3] if key else True,
                                        Shapes(len(self.kv_lens), self.num_qo_heads,
                                               self.num_kv_heads, kv, kv, self.head_dim,
                                               self.head_dim)))
            if key is not None:
                if len(self._reads_cache) > 64:
                    self._reads_cache.clear()
                self._reads_cache[key] = hit
        _, safe, sizes = hit
        if not sizes:
            return safe, bindings
        return safe, Bindings({**bindings.scalars, **sizes}, bindings.tensors)

    def _variant_ir(self) -> VariantIR:
        """The variant's traced IR, for plan()'s checks (traced once; run() traces again for the
        captured values of that call)."""
        if self._ir is None:
            self._ir = self.variant.trace()[0]
        return self._ir

    @staticmethod
    def _section_tokens(tiles: BatchTiles, head_dim: int, dtype: torch.dtype) -> int | None:
        """clip_causal_units' L2 sections for the FA3 batch kernel (None for FA2, whose paged
        causal prefill the sectioned order slowed down; docs/serving.md, "Causal clipping and
        L2 sections")."""
        if tiles.kernel != "fa3":
            return None
        return L2_SECTION_BYTES // (2 * head_dim * dtype.itemsize)

    def _causal_bound(self) -> int | None:
        """attncc.ir.kv_bound.causal_bound of the variant's mask (None: no mask, or no bound
        its structure proves); computed once."""
        if self._kv_bound is False:
            from attncc.ir.kv_bound import causal_bound
            from attncc.ir.simplify import simplify_variant

            mask = simplify_variant(self._variant_ir()).hook("mask_mod")
            self._kv_bound = None if mask.is_identity else causal_bound(mask.expr)
        return self._kv_bound  # type: ignore[return-value]

    def _fa3_mode(self, group: int, head_dim: int, page_size: int,
                  q_dtype: torch.dtype) -> str:
        """choose_batch_tiles' `fa3`: "off" when the FA3 batch kernel cannot run this batch (or
        kernel="fa2"), "on" when forced (kernel="fa3"; raises if it cannot), else "auto"."""
        if self.kernel == "fa2" or (self.kernel is None and self._forced_tiles is not None):
            return "off"
        key = (group, head_dim, page_size, q_dtype)  # memoised: plan() runs every step
        why = self._fa3_why.get(key, False)
        if why is False:
            why = self._fa3_why[key] = fa3_unsupported(
                self.device, head_dim=head_dim, group=group, kv_layout=self.kv_layout,
                page_size=page_size, q_dtype=q_dtype)
        if self.kernel == "fa3":
            if why is not None:
                raise ValueError(f"BatchAttention(kernel='fa3') needs {why}; use kernel=None "
                                 f"or 'fa2'")
            return "on"
        return "off" if why is not None else "auto"

    def _config_key(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page: int,
                    q_dtype: Any) -> tuple:
        """What a plan's config depends on besides its batch's longest query: the arguments
        and every knob `_config` reads (a knob changed between plans is honoured)."""
        return (head_dim, num_qo_heads, num_kv_heads, page, q_dtype, self.kernel, self.tiles,
                self._planner, self.min_kv_chunk, self.max_batch, self.max_qo_tokens,
                self.max_pages, self.kv_layout, self._forced_tiles, self.balance)

    def _config(self, b: CheckedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                q_dtype: Any) -> _Config:
        """The tiles, layout and scheduler arguments of batch `b`: the last ones again when
        everything they depend on is the last call's (a serving loop's every step: a decode
        batch is the same shape step after step)."""
        key = self._config_key(num_qo_heads, num_kv_heads, head_dim, b.page, q_dtype)
        memo = self._last_config
        if memo is not None and memo[0] == key and memo[1] == b.max_q_len:
            return memo[2]
        group = num_qo_heads // num_kv_heads
        fa3 = self._fa3_mode(group, head_dim, b.page, q_dtype)
        tiles = self._tiles_for(head_dim, b.max_q_len * group, fa3)
        # 128 tokens: it beat 256 on small GQA decode batches and 64 was no better; at batch >= 64
        # the floor does not bind (measured: docs/journal/2026-12-01.md, "merge kernel rows")
        floor = self.min_kv_chunk or 128
        if not self.balance:  # one CTA per work item, each item's whole KV range in one unit
            items = num_kv_heads * int(np.sum(-(-(np.diff(b.qo) * group) // tiles.tq)))
            tiles = dataclasses.replace(tiles, num_ctas=max(items, 1))
            floor = max(int(b.kv_lens.max(initial=0)), 1)
        layout = _plan_layout(self.max_batch, self.max_qo_tokens, tiles.num_ctas, num_qo_heads,
                              num_kv_heads, tiles.tq)
        # the FA3 batch kernel runs one KV head per unit (kernels/fa3/fa3_batch.cuh)
        span = tiles.kernel != "fa3"
        kwargs = dict(kv_chunk_align=tiles.tkv, min_kv_chunk=floor, head_span=span)
        problem = None
        if self._planner:
            # scheduler.plan's checks of these (the same errors as plan_into would raise)
            _, tq, ctas, alpha, beta, align, floor = scheduler._checked_params(
                num_qo_heads, num_kv_heads, tiles.tq, tiles.num_ctas, 1.0, 1.0, tiles.tkv, floor)
            problem = planner.plan_problem(layout, num_ctas=ctas, alpha=alpha, beta=beta,
                                           align=align, floor=floor, head_span=span)
        cfg = _Config(tiles, layout, kwargs, problem)
        if self.balance:  # (without it the grid depends on the whole batch: nothing to keep)
            self._last_config = (key, b.max_q_len, cfg)
        return cfg

    def _tiles_for(self, head_dim: int, max_fused_rows: int, fa3: str = "off") -> BatchTiles:
        """`choose_batch_tiles` for this device, keeping the captured kernel's tiles when the
        new batch fits them."""
        forced = tuple(self._forced_tiles) if self._forced_tiles is not None else None
        tiles = _batch_tiles(head_dim, max_fused_rows, num_sms(self.device), forced, fa3)
        if self.tiles is not None and tiles.tq != self.tiles.tq and self.tiles.tq >= tiles.tq \
                and (self.tiles.kernel == "fa2" or fa3 != "off"):
            tiles = self.tiles  # keep the captured kernel when the new batch fits its tiles
        return tiles

    def workspace_bytes(self) -> int:
        """Bytes of workspace the current plan's layout needs (plan, page tables, partials)."""
        if self.layout is None:
            raise RuntimeError("call plan() first: the workspace size depends on the layout")
        return 4 * self._int_words() + scheduler.workspace_bytes(
            self.layout, self.head_dim, self.num_qo_heads, 4)

    def _int_words(self, layout: scheduler.PlanLayout | None = None) -> int:
        """int32 words of the plan (`layout`, default the current one) and the page tables."""
        lay = layout if layout is not None else self.layout
        assert lay is not None
        mb = self.max_batch + 1
        return lay.size + 4 * _pad4(mb) + _pad4(self.max_qo_tokens) + _pad4(self.max_pages)

    def _staging_for(self, layout: scheduler.PlanLayout
                     ) -> tuple[int, np.ndarray, dict[str, int]]:
        """The half of the pinned staging buffer the next plan writes (its index and a numpy
        view; each half large enough for `layout`) and the word offsets of the page tables
        after `layout`'s plan. Plans take the halves in turn, so this waits only until the copy
        of the plan before last has read the half, not for the last plan's copy."""
        if layout is not self._staging_layout:  # (the same layout step after step: no sizes)
            words = self._int_words(layout)
            if not self._halves or self._halves[0].size < words:
                if self._uploader is not None:  # copies still reading the old buffer finish
                    self._uploader.wait(0)
                    self._uploader.wait(1)
                self._staging = st = torch.zeros(2 * words, dtype=torch.int32,
                                                 pin_memory=self.device.type == "cuda")
                self._halves = (st[:words].numpy(), st[words:].numpy())
                self._halves_at = (st.data_ptr(), st.data_ptr() + 4 * words)
            self._staging_layout, self._staging_offsets = layout, self._table_offsets(layout)
        half = 1 - self._half
        if self._uploader is not None:
            self._uploader.wait(half)  # the copy of the plan before last has read this half
        return half, self._halves[half], self._staging_offsets

    def _table_offsets(self, layout: scheduler.PlanLayout) -> dict[str, int]:
        """Word offsets of the page tables in the staging buffer (and the workspace): after the
        packed plan of `layout`, each table's room set by the instance's maxima."""
        off = layout.size
        mb = _pad4(self.max_batch + 1)
        qcap = _pad4(self.max_qo_tokens)
        pages = off + 4 * mb + qcap
        return {"qo_indptr": off, "kv_page_indptr": off + mb, "kv_lens": off + 2 * mb,
                "kv_pos": off + 3 * mb, "q_pos": off + 4 * mb, "pages": pages}

    def _stage(self, buf: np.ndarray, b: CheckedBatch, o: dict[str, int]) -> None:
        """Write the page tables at the word offsets `o` of the staging buffer `buf` (numpy:
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

    def _upload(self, used: int, ranges: list[tuple[int, int]] | None = None) -> None:
        """Copy the current plan's staged words to the workspace (CUDA), allocating the
        workspace at the first plan. Only the words this plan uses (`used`: one past the last):
        the plan's room and the page tables' are sized for the instance's maxima (so the tables
        sit at fixed offsets, where a captured graph's kernels read them), and copying the whole
        region -- 1.5 MB at Hkv 32 and batch 256 -- would cost ~60 us of copy on the stream
        before every run. `ranges` (the compiled planner's list) or else `used_ranges` lists the
        used words: the plan, one range, and the tables, joined when close -- one or two
        copies, each an async copy on the current stream (~3 us of host time each); then the
        half's event is recorded for `_staging_for`."""
        ws, lay = self._workspace_for(used), self.layout
        assert lay is not None
        if ranges is None:
            ranges = used_ranges(self._staging_np, lay, self._offsets["qo_indptr"], used)
        if self._uploader is None:
            self._uploader = _Uploader(self.device)
        self._uploader.copy(ws.data_ptr(), self._halves_at[self._half], self._half, ranges)

    def _workspace_for(self, used: int) -> torch.Tensor:
        """The workspace, allocated at the first plan, checked to hold the current layout's
        plan, tables and partials; not checked again while the workspace, layout and head dim
        are the last check's and the `used` words lie within the int32 words it checked."""
        ws, lay = self.workspace, self.layout
        last = self._ws_checked
        if ws is not None and ws is last[0] and lay is last[1] and self.head_dim == last[2] \
                and used <= last[3]:
            return ws
        need = self.workspace_bytes()
        if ws is None or ws.numel() < need:
            if ws is not None:
                raise ValueError(f"workspace_buffer has {ws.numel()} bytes; this layout "
                                 f"needs {need} (BatchAttention.workspace_bytes())")
            ws = self.workspace = torch.empty(need, dtype=torch.uint8, device=self.device)
        if ws.dtype != torch.uint8 or ws.device != self.device:
            raise ValueError("workspace_buffer must be a uint8 tensor on the kernel's device")
        self._ws_checked = (ws, lay, self.head_dim, self._int_words())
        return ws

    # ------------------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, kv_cache: Any, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False,
            scale: float | None = None) -> Any:
        """Attention of the planned batch: `out [total_q, num_qo_heads, head_dim]` (and `lse
        [total_q, num_qo_heads]` float32 with `return_lse`). CUDA-graph capturable once the
        kernels are compiled (call run once before capturing); replays use the latest plan.
        `q` may have more rows than the plan's `total_q` (a static buffer a graph captures
        once): only the plan's rows are read, and `out` / `lse` have q's rows."""
        if self._plan is None or self.tiles is None or self.layout is None:
            raise RuntimeError("call plan() before run()")
        if self.device.type != "cuda":
            raise ValueError("BatchAttention.run needs CUDA tensors; use "
                             "batch_attention_reference on the CPU")
        k, v, strides = self._cache_views(kv_cache)
        total_q = int(self.qo_indptr[-1])
        H, D = self.num_qo_heads, self.head_dim
        if (not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] < total_q
                or q.shape[1:] != (H, D) or q.device != self.device
                or q.dtype not in (torch.bfloat16, torch.float16) or q.stride(2) != 1
                or q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8):
            raise ValueError(f"q must be a bf16/fp16 CUDA tensor [{total_q}, {H}, {D}] (the "
                             f"planned batch; more rows are allowed) with a contiguous, 16-byte "
                             f"aligned head dim; got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q)}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"kv_cache dtype {k.dtype} != q dtype {q.dtype}")
        ir, bindings = self._safe_reads(*self.variant.trace())
        if not ir.use_softmax and (return_lse or lse is not None):
            raise ValueError("return_lse=True but the variant has normalize='none'")
        kern = _kernels_for(ir, D, "bfloat16" if q.dtype == torch.bfloat16 else "float16",
                            self.tiles, self.device.index or 0)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor")
        if (return_lse or lse is not None) and lse is None:
            lse = torch.empty(q.shape[0], H, dtype=torch.float32, device=self.device)
        if lse is not None and (lse.shape != (q.shape[0], H) or lse.dtype != torch.float32
                                or lse.stride(1) != 1):
            raise ValueError(f"lse must be a ({q.shape[0]}, {H}) float32 tensor")
        ws = self.workspace
        assert ws is not None
        base = ws.data_ptr()
        lay, o = self.layout, self._offsets
        words = self._int_words()
        # scheduler.workspace_bytes' layout: every slot's fp32 O first, then the LSEs
        rows = lay.max_partial_slots * lay.tile_q
        lse_off = 4 * words + _round256(rows * D * 4)
        bp = {
            "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(),
            "lse": lse.data_ptr() if lse is not None else 0,
            "partial_o": base + 4 * words, "partial_lse": base + lse_off,
            "qo_indptr": base + 4 * o["qo_indptr"], "kv_page_indptr": base + 4 * o["kv_page_indptr"],
            "kv_page_indices": base + 4 * o["pages"], "kv_lens": base + 4 * o["kv_lens"],
            "q_positions": base + 4 * o["q_pos"] if self._has_q_pos else 0,
            "kv_pos_offset": base + 4 * o["kv_pos"] if self._has_kv_pos else 0,
            "plan": base + 4 * lay.offsets["header"],  # the kernels find the sections in it
            "q_stride_tok": q.stride(0), "q_stride_h": q.stride(1),
            "o_stride_tok": out.stride(0), "o_stride_h": out.stride(1),
            "kv_stride_page": strides[0], "kv_stride_slot": strides[1], "kv_stride_h": strides[2],
            "lse_stride_tok": lse.stride(0) if lse is not None else 0,
            "num_q_heads": H, "num_kv_heads": self.num_kv_heads,
            "page_size": self.page_size, "page_shift": self.page_shift,
            "sm_scale": 1.0 / math.sqrt(D) if scale is None else float(scale),
            "tma": 0,
        }
        if self.tiles.kernel == "fa3":
            bp["tma"] = fa3_batch_maps(q, k, v, group=H // self.num_kv_heads,
                                       row_stride=strides[1],
                                       box_rows=min(self.page_size, self.tiles.tkv)).data_ptr()
        from attncc.codegen.generate import variant_param_values

        cap = captured(kern.ir, bindings, self.device)
        vp = variant_param_values(kern.attend.vp.layout, cap["scalars"], cap["tensors"])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        cfg = kern.config
        kern.attend.launch((lay.max_ctas, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes,
                           kern.attend.ap.flatten(bp), kern.attend.vp.flatten(vp), stream=stream)
        if lay.max_merges:  # the split items' merge
            grid = min(lay.max_merges, num_sms(self.device))
            kern.merge.launch((grid, 1, 1), (MERGE_THREADS, 1, 1), 0,
                              kern.merge.ap.flatten(bp),
                              kern.merge.vp.flatten(vp), stream=stream, pdl=self._pdl)
        return (out, lse) if return_lse else out

    def _cache_views(self, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor,
                                                   tuple[int, int, int]]:
        """(k, v, (stride_page, stride_slot, stride_head)) in elements; checks the shapes."""
        Hkv, D = self.num_kv_heads, self.head_dim
        if isinstance(kv_cache, torch.Tensor) and self.kv_layout != "ragged":
            if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
                raise ValueError(f"kv_cache as one tensor must be [num_pages, 2, ...] (k and v); "
                                 f"got {tuple(kv_cache.shape)}")
            k, v = kv_cache[:, 0], kv_cache[:, 1]
        elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
            k, v = kv_cache
        else:
            raise ValueError("kv_cache must be (k_cache, v_cache) or a [num_pages, 2, ...] tensor")
        for name, t in (("k_cache", k), ("v_cache", v)):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                raise ValueError(f"{name} must be a tensor on {self.device}")
            if self.kv_layout == "ragged":
                want = (self._max_page, Hkv, D)
                ok = t.dim() == 3 and t.shape[0] >= want[0] and t.shape[1:] == want[1:]
            else:
                pg = self.page_size
                want = ((self._max_page, pg, Hkv, D) if self.kv_layout == "NHD"
                        else (self._max_page, Hkv, pg, D))
                ok = t.dim() == 4 and t.shape[0] >= want[0] and t.shape[1:] == want[1:]
            if not ok:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan needs "
                                 f"{'[>=' + str(want[0]) + ', ' + ', '.join(map(str, want[1:]))}]"
                                 f" ({self.kv_layout} layout; every page id and token must fit)")
            if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
                raise ValueError(f"{name} needs a contiguous, 16-byte aligned head dim")
        if k.stride() != v.stride():
            raise ValueError(f"k_cache and v_cache must have the same strides; got {k.stride()} "
                             f"and {v.stride()}")
        if self.kv_layout == "ragged":
            strides = (k.stride(0), k.stride(0), k.stride(1))
        elif self.kv_layout == "NHD":
            strides = (k.stride(0), k.stride(1), k.stride(2))
        else:
            strides = (k.stride(0), k.stride(2), k.stride(1))
        return k, v, strides


def _serving_clamps(ir: VariantIR, tensors: dict, scalars: dict, positions_unknown: bool,
                    shapes: Shapes) -> tuple[VariantIR, dict[str, int]]:
    """BatchAttention's clamped variant and clamp sizes (see BatchAttention._safe_reads)."""
    from attncc.ir.analysis import CapturedReadError, clamp_reads, load_guards
    from attncc.ir.simplify import simplify_variant

    if not positions_unknown:
        try:
            got, sizes = clamped(ir, shapes, tensors, scalars)
            return got, sizes
        except CapturedReadError:
            pass  # clamp every read instead
    simple = simplify_variant(ir)
    every = {n: tuple(range(len(n.args))) for h in simple.hooks.values()
             for n, _ in load_guards(h.expr).values() if n.args}
    return clamp_reads(simple, every, tensors)


def clip_causal_units(buf: np.ndarray, layout: scheduler.PlanLayout, qo: np.ndarray,
                      kv_lens: np.ndarray, group: int, bound: int, qpos: np.ndarray | None = None,
                      kvoff: np.ndarray | None = None, section_tokens: int | None = None) -> None:
    """End every packed work unit's KV range where its mask keeps nothing more: a mask with
    kv_idx <= q_idx + bound (attncc.ir.kv_bound) keeps no key past its unit's last query
    position + bound, so a causal prefill tile stops at its diagonal instead of its request's
    end -- about half a causal prefill's tiles, which the kernels would only mask away. A unit
    whose range becomes empty writes an empty partial state (the merge skips it). The CTA
    queues are then rebalanced (longest first) on the clipped costs. In place, on
    the staged plan words `buf` (the positions the hooks see: `qpos` per query token if given,
    else kv_len - q_len + t; keys shifted by `kvoff` per request if given).

    `section_tokens`: rebalance in L2 sections -- the (request, KV head) pairs in order, cut
    wherever their K/V passes another `section_tokens` tokens, each section's units assigned
    (longest first) before the next one's (`lpt_schedule(section=...)`). Longest first over the
    whole batch starts every head's longest query tile at once: at S = 2048 x 128 heads the
    first rounds then read ~128 heads' K/V, more than the L2 holds, where the sections keep the
    CTAs on a few heads at a time (the dense FA3 kernel's item order does the same).

    Example:
        >>> from attncc.runtime.serving.plan import scheduler
        >>> lay = scheduler.PlanLayout(4, 64, 2, 1, 1, 16)
        >>> buf = np.zeros(lay.size, np.int32)
        >>> qo, kv = np.array([0, 40]), np.array([40])
        >>> scheduler.plan_into(buf, lay, qo, kv, 1, 1, 16, 2, kv_chunk_align=16, min_kv_chunk=16)
        >>> clip_causal_units(buf, lay, qo, kv, 1, 0)
        >>> u = lay.unpack(buf)["units"].view(np.int32).reshape(3, 8)
        >>> u[:, [3, 4, 5, 6]].tolist()   # q rows [start, +rows) -> keys [start, end)
        [[0, 16, 0, 16], [16, 16, 0, 32], [32, 8, 0, 40]]
    """
    p = layout.unpack(buf)  # views: the writes below land in `buf`
    u = p["units"]
    req, q_start = u["request"], u["q_start"]
    first_tok, last_tok = q_start // group, (q_start + u["q_rows"] - 1) // group
    if qpos is None:
        q_max = kv_lens[req] - (qo[req + 1] - qo[req]) + last_tok
    else:  # the largest given position among each unit's tokens
        q_max = np.array([qpos[o + f:o + t + 1].max() for o, f, t in
                          zip(qo[req].tolist(), first_tok.tolist(), last_tok.tolist())],
                         dtype=np.int64).reshape(-1)
    limit = q_max + bound + 1 - (kvoff[req] if kvoff is not None else 0)
    heads = u["kv_heads"].astype(np.int64)
    before = int(((u["kv_end"] - u["kv_start"]) * heads).sum())
    u["kv_end"] = np.clip(limit, u["kv_start"], u["kv_end"])
    keys = u["kv_end"] - u["kv_start"]
    # The CTA queues were balanced on the unclipped costs, and the clipped units of a causal
    # prefill range from empty to whole: balance them again (same cost rule as the scheduler,
    # alpha = beta = 1, times the unit's KV heads) unless clipping removed under a tenth of the
    # keys (a mixed step with one short prefill chunk: not worth the host time). Merges sum
    # their slots in the plan's order, whatever CTA ran them, so the output bits do not depend
    # on the new queues. (A unit's heads share its rows and KV range: one clip fits them all.)
    if 10 * (before - int((keys * heads).sum())) < before:
        return
    section = None
    if section_tokens:
        hk = layout.num_kv_heads
        kv = np.asarray(kv_lens, dtype=np.int64)
        pair0 = hk * (np.cumsum(kv) - kv)  # K/V tokens of the pairs of the requests before
        section = (pair0[req] + u["kv_head"] * kv[req]) // int(section_tokens)
    p["cta_indptr"][:], p["cta_units"][:] = lpt_schedule(
        (u["q_rows"].astype(np.int64) + keys) * heads, p["num_ctas"], section=section)


L2_SECTION_BYTES = constants.L2_SECTION_BYTES
"""K/V bytes of the (request, KV head) pairs a causal prefill plan's CTAs work on at a time
(`clip_causal_units`' sections; 12 MiB of the H100 / H200's 50 MB L2, as the dense FA3 kernel's
ATTNCC_FA3_L2_SECTION_BYTES: attncc.codegen.constants), for K and V of
q_data_type's element size. Paged causal prefill is insensitive to 12 vs 24 MiB, the dense
kernel prefers 12 (docs/serving.md#causal-clipping-and-l2-sections)."""

UPLOAD_GAP = 16384
"""`used_ranges`' default: int32 words (64 KB) of unused room that one copy may carry between two
used ranges rather than issuing another copy. Each cuMemcpyHtoDAsync costs the host a few
microseconds and the copy engine a fixed start-up; 64 KB of extra copy costs the engine about as
much (~2-3 us over PCIe) and the host nothing. A plan is one range (since PLAN_VERSION 5) and
its page tables another: one copy when the plan fills its room to within 64 KB, else two."""


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
    the page tables are read per planned request (tests/test_batch.py,
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


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _round256(n: int) -> int:
    return (n + 255) // 256 * 256
