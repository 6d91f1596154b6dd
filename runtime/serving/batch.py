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

BatchAttention composes the roles that live beside it (docs/serving.md, module map):
`tiles` (tile choice and the plan config), `staging` (the word map, the pinned staging halves
and the upload), `causal` (causal clipping of the staged units), `reads` (clamped captured
reads), `operands` (run()'s tensor checks) and `launch` (one launch-argument builder per kernel
kind, and the launches). Kernels come from `_kernels_for` below.

Example (CPU: the plan and its checks; `run` on a CPU plan computes the float64 reference
`batch_attention_reference`, the kernels need a CUDA GPU):
    >>> import torch
    >>> ba = BatchAttention(None, kv_layout="NHD", device="cpu")
    >>> ba.plan(torch.tensor([0, 1, 3]), torch.tensor([0, 2, 3]), torch.tensor([4, 0, 2]),
    ...         torch.tensor([16, 5]), num_qo_heads=8, num_kv_heads=2, head_dim=128,
    ...         page_size=16)
    >>> ba.kv_lens.tolist(), ba.tiles.tq
    ([32, 5], 16)
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from attncc.codegen.tiles import fa3_tiles
from attncc.errors import DeviceError, InvalidArgument, check_bool, check_int
from attncc.frontend import Variant
from attncc.ir.program import TRANSFORM_HOOKS, Bindings, VariantIR

from ..jit.device import num_sms
from ..jit.launch_args import captured
from ..jit.kernels import KernelTiles, KernelRecord, KernelSpec, LoadedKernel, get_kernel
from ..jit.launcher import current_raw_stream
from ..jit.tiles import HEAD_DIMS
from ..reference import batch_attention_reference, check_sinks
from . import launch
from .capture import LaunchShape, capture_mismatch
from .causal import clip_causal_units, mask_causal_bound, section_tokens
from .fa3_batch import fa3_unsupported, pair_form_runs
from .operands import (HeadDims, PlannedShape, cache_views, check_kv_dtype, check_lse, check_out,
                       check_q, plan_head_dims)
from .plan import planner, scheduler
from .plan.checks import KV_LAYOUTS, RAGGED_PAGE, CheckedBatch, check_batch, int_array, page_shift
from .reads import SafeReads
from .scales import KvScales, check_kv_data_type
from .staging import UPLOAD_GAP, Staging, Uploader, int_words, stage_tables, table_offsets
from .staging import used_ranges  # (looked up here at each upload: bench/plan_time.py times it)
from .tiles import (BatchTiles, PlanConfig, batch_tiles, fa3_mode, keep_captured_depth,
                    keep_captured_tiles, long_kv_batch, plan_config)
from .tree_mask import TreeTable, tree_rows
# importable from here as before (tests, bench/, scripts/); the role modules own them
from .causal import L2_SECTION_BYTES  # noqa: F401
from .staging import Uploader as _Uploader, coalesce_ranges  # noqa: F401
from .tiles import choose_batch_tiles  # noqa: F401

__all__ = ["BatchAttention", "BatchTiles", "clip_causal_units", "KV_LAYOUTS"]


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


_Staged = tuple[PlanConfig, int, np.ndarray, dict, bool]
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


def _kernels_for(ir: VariantIR, head_dim: int, dtype: str, tiles: BatchTiles,
                 device: int, kv8: torch.dtype | None = None,
                 head_dims: tuple[int, int] | None = None) -> LoadedKernel:
    """The batch kernel and its merge kernel (`.launcher`, `.merge`) for one (variant, head
    dim, dtype, tiles, fp8 cache dtype `kv8` or None, a padded form's real `head_dims`), from
    the kernel cache (runtime/jit/kernels.py)."""
    if kv8 is not None and tiles.stages < 2:
        raise ValueError(f"an fp8 KV cache streams through a ring of 2 * (stages - 1) fp8 "
                         f"stages: tiles={tiles.tq, tiles.tkv, tiles.stages} needs stages >= 2")
    if tiles.kernel == "fa3":
        spec = KernelSpec("fa3_batch", ir, head_dim, dtype,
                          fa3_tiles(tiles.stages, tiles.tkv, tiles.tq), device=device)
    else:
        spec = KernelSpec("decode" if tiles.kv_warps > 1 else "fa2_batch", ir, head_dim, dtype,
                          KernelTiles(tiles.tq, tiles.tkv, tiles.stages, tiles.m_frags,
                                      tiles.kv_warps, tiles.half_rows), device=device,
                          kv_dtype=str(kv8).removeprefix("torch.") if kv8 is not None else None,
                          head_dims=head_dims)
    return get_kernel(spec)


def _host_copy(a: Any) -> Any:
    """A copy of a plan() argument that the caller may change after plan (None stays)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", copy=True)
    return None if a is None else np.array(a, copy=True)


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
                          "plans and runs it (no kernels)")



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
        self._safe = SafeReads()  # _safe_reads' memo
        self._kv_bound: int | None | bool = False  # _causal_bound's memo (False: not yet)
        self._fa3_why: dict[tuple, str | None] = {}  # _fa3_mode's memo of fa3_unsupported
        self.min_kv_chunk = None if min_kv_chunk is None else int(min_kv_chunk)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.workspace = workspace_buffer
        # a workspace allocated here grows with the plans' layouts until a CUDA graph captures
        # run() (a captured kernel keeps reading the buffer it was captured with)
        self._own_workspace, self._graph_captured = workspace_buffer is None, False
        self.tiles: BatchTiles | None = None
        self.layout: scheduler.PlanLayout | None = None
        self._stager = Staging()  # the pinned staging halves (_staging_for)
        self._offsets: dict[str, int] = {}  # word offsets of the current plan's page tables
        self._uploader: Uploader | None = None  # copies and their events (the first upload)
        self._ws_checked: tuple = (None, None, 0, 0)  # _workspace_for's memo
        self._plan: _LazyPlan | None = None  # the typed plan, computed when looked at
        self._planner: planner.BatchPlanner | None | bool = None  # None: not made yet
        # _config's memo: (_config_key, longest query, PlanConfig) of the last config
        # (config key, (longest query, long_kv_batch), config) of the last plan
        self._last_config: tuple[tuple, tuple[int, bool], PlanConfig] | None = None
        # launch the merge kernel with programmatic dependent launch (sm_90+): its launch and
        # plan prologue overlap the attention kernel's tail (kernels/common/batch_params.cuh)
        self._pdl = True
        self._sinks32: torch.Tensor | None = None  # run()'s float32 sinks (_sinks_operand)
        self._host_batch: tuple = ()  # a CPU plan's arguments, for run()'s reference
        self._tree: TreeTable | None = None  # the tree-mask table (CUDA: made at the first plan)
        self._tree_plan = False  # whether the plan being made / the current plan has a tree mask
        # the plan's real (query/key, value) head dims when they run the padded form, else None
        self._padded_plan: tuple[int, int] | None = None
        self.head_dim_vo: int | None = None  # the current plan's value head dim
        self._width = 0  # its kernels' head dim (padded width; operands.plan_head_dims)
        # a CUDA graph captured the FA3 batch kernel's 128-row form (which reads no tree masks)
        self._fa3_captured = False
        self._captured: LaunchShape | None = None  # what the last captured run fixed (capture.py)
        self.kv_data_type: torch.dtype | None = None  # the plan's fp8 cache dtype (None: q's)
        self._scales = KvScales()  # run()'s k_scale / v_scale pointers
        from .ops import register_batch  # torch.compile's op finds this object by it

        self.op_handle = register_batch(self)

    # the current plan's staging half, as the staging role holds it (tests and bench/ read them)
    _halves = property(lambda self: self._stager.halves)
    _halves_at = property(lambda self: self._stager.halves_at)
    _half = property(lambda self: self._stager.half)
    _staging_np = property(lambda self: self._stager.current)

    # ------------------------------------------------------------------------------ plan
    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any = None,
             kv_last_page_len: Any = None, *, num_qo_heads: int, num_kv_heads: int,
             head_dim: int | None = None, page_size: int = 1, q_positions: Any = None,
             kv_position_offset: Any = None,
             q_data_type: torch.dtype = torch.bfloat16, custom_mask: Any = None,
             packed_custom_mask: Any = None, kv_data_type: torch.dtype | None = None,
             head_dim_qk: int | None = None, head_dim_vo: int | None = None) -> None:
        """Schedule one batch. Paged layouts: `kv_indptr` is the CSR of page ids `kv_indices`
        per request and `kv_last_page_len` the tokens used in each request's last page;
        "ragged": `kv_indptr` is the CSR of KV tokens (no indices, no page size). Host-side
        arrays (CPU tensors, numpy, lists); invalid input raises here, naming the argument.

        Positions the hooks see: by default query token t of request i is position
        `kv_len_i - q_len_i + t` and KV token j is position j. `q_positions` ([total query
        tokens]) overrides the first and `kv_position_offset` ([batch]) shifts the second --
        what CascadeAttention uses for a shared prefix and the suffixes after it.
        `q_data_type` is the dtype `run` will get; `kv_data_type` the KV cache's (None: q's),
        `torch.float8_e4m3fn` / `torch.float8_e5m2` for an fp8 cache, which `run` reads with
        its `k_scale` / `v_scale` (docs/serving.md, "fp8 KV cache").

        Head dims: `head_dim` (or FlashInfer's name `head_dim_qk`) is q's and k's, `head_dim_vo`
        v's and the output's (default: the same); multiples of 8 from 32 to 256. Other than one
        dim of 64/128/256 they run the FA2 kernels' padded form (docs/serving.md, "Head dims").

        `custom_mask` / `packed_custom_mask` (FlashInfer's names and layout: each request's
        `[q_len, kv_len]` bool mask, row-major, concatenated; or each one bit-packed with
        `bitorder="little"`): a multi-token decode tree mask, ANDed with the variant's mask. The
        kernels take trees: at most 16 query tokens per request, every key before the step's
        own tokens kept (docs/serving.md, "Multi-token decode and tree masks"); no q_positions.

        Host time: with the compiled planner (plan/planner.c) a plan whose tiles are the
        last plan's (a serving loop's every step) is one C call,
        `planner.BatchPlanner.plan`: it checks the arrays, computes the plan straight into the
        pinned staging buffer, writes the page tables after it and lists the used words; other
        plans check first and stage after choosing their tiles (`BatchPlanner.plan_and_stage`).
        On CUDA then one or two async copies of the used words and an event record
        (`_upload`).
        bench/plan_time.py measures it (`--phases`: step by step). Without a C compiler the
        same words come from numpy (`scheduler.plan_into` and `stage_tables`).
        """
        b, staged = None, None
        dims = plan_head_dims(head_dim, head_dim_qk, head_dim_vo)
        head_dim = dims.width  # the kernels' (and the plan config's) head dim
        tree = custom_mask is not None or packed_custom_mask is not None
        kv8 = check_kv_data_type(kv_data_type, q_data_type, self.device)
        if tree:
            self._check_tree(q_positions, kv8)
        self._tree_plan = tree  # (read by _config_key and _tiles_for: FA2 or FA3's pair form)
        self._padded_plan = self._check_padded(dims, kv8)  # (read there too: padded -> FA2)
        if q_positions is None and kv_position_offset is None:
            b, staged = self._checked_fast(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                           num_qo_heads, num_kv_heads, head_dim, page_size,
                                           q_data_type, kv8)
        fast = b is not None
        if b is None:
            b = self._checked(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                              num_kv_heads, head_dim, page_size, q_positions, kv_position_offset)
        rows = tree_rows(custom_mask, packed_custom_mask, b.qo, b.kv_lens) if tree else None
        if staged is None:
            staged = self._stage_plan(b, fast, num_qo_heads, num_kv_heads, head_dim,
                                      q_data_type, kv8)
        cfg, half, buf, offsets, c_staged = staged
        self._check_captured(cfg, offsets, b, (num_qo_heads, num_kv_heads), (dims.qk, dims.vo),
                             kv8)
        self._clip_causal(buf, cfg, b, num_qo_heads // num_kv_heads, head_dim, q_data_type)
        # (only now: a plan() that raised leaves the last plan's layout and offsets for run())
        self._commit(b, cfg, half, buf, offsets, num_qo_heads, num_kv_heads, dims)
        self.kv_data_type = kv8
        if kv8 is not None:  # (here, not in run(): maybe inside a compiled CUDA graph)
            self._scales.reserve(num_kv_heads, self.device)
        if self.device.type != "cuda":  # what run()'s reference reads (CPU plans only)
            self._host_batch = tuple(_host_copy(a) for a in (
                qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask,
                packed_custom_mask, q_positions, kv_position_offset))
        if self.device.type == "cuda":
            self._upload_tree(rows)
            if c_staged:  # planner.c listed the used words
                self._upload(*self._planner.used_ranges()[::-1])
            else:
                self._upload(offsets["pages"] + int(b.page_indptr[-1]))

    def _check_tree(self, q_positions: Any, kv8: torch.dtype | None) -> None:
        """plan()'s checks of a tree mask against what its kernels read."""
        if q_positions is not None:
            raise ValueError("custom_mask / packed_custom_mask with q_positions: a tree mask "
                             "is indexed by the step's tokens, which q_positions re-numbers; "
                             "leave q_positions out")
        if self._fa3_captured:
            raise ValueError("a CUDA graph captured run() with the FA3 batch kernel's 128-row "
                             "form, which does not read tree masks, so its replays would ignore "
                             "this mask; capture the multi-token decode loop on a plan of its own "
                             "batches (or pass kernel='fa2' to the BatchAttention that a graph "
                             "captures)")
        if kv8 is not None:
            raise ValueError(f"custom_mask / packed_custom_mask with kv_data_type={kv8}: the fp8 "
                             f"cache's kernels do not read tree masks; use a 16-bit cache for "
                             f"tree-masked steps, or plan without the mask")

    def _check_padded(self, dims: HeadDims, kv8: torch.dtype | None) -> tuple[int, int] | None:
        """The real head dims a padded plan's kernels take (None: native dims), checked against
        what the padded form runs: FA2, a 16-bit cache, a variant without q/k/v/output hooks."""
        if not dims.padded:
            return None
        what = f"head dims {dims.qk}/{dims.vo} (q/k, v) run the FA2 kernels' padded form"
        if self.kernel == "fa3":
            raise InvalidArgument(f"BatchAttention(kernel='fa3') with {what}; use kernel=None "
                                  f"or 'fa2', or head dims 64/128 for q, k and v")
        if kv8 is not None:
            raise InvalidArgument(f"kv_data_type={kv8} with {what}, which reads 16-bit caches; "
                                  f"use a 16-bit cache or head dim 64, 128 or 256")
        from attncc.ir.hoist import transforms_in

        rows = transforms_in(self._variant_ir(), TRANSFORM_HOOKS)
        if rows:
            raise InvalidArgument(f"variant {self.variant.name!r} has {', '.join(rows)}: with "
                                  f"{what}, whose padding columns these hooks would see; use "
                                  f"head dim 64, 128 or 256 for q, k and v")
        return dims.qk, dims.vo

    def _upload_tree(self, rows: np.ndarray | None) -> None:
        """The plan's tree-mask rows (None: no mask) to the device table, made at the first
        CUDA plan so that every run -- and a CUDA graph capturing one -- points at it."""
        if self._tree is None:
            self._tree = TreeTable(self.max_batch, self.device)
        self._tree.upload(rows)

    def _clip_causal(self, buf: np.ndarray, cfg: PlanConfig, b: CheckedBatch, group: int,
                     head_dim: int, q_dtype: torch.dtype) -> None:
        """Causal clipping of the staged units (`causal.clip_causal_units`) when the mask is
        bounded and the batch has a query longer than one token (decode: nothing to clip)."""
        bound = self._causal_bound() if b.max_q_len > 1 else None
        if bound is not None:
            clip_causal_units(buf, cfg.layout, b.qo, b.kv_lens, group, bound, b.qpos, b.kvoff,
                              section_tokens(cfg.tiles.kernel, head_dim, q_dtype))

    def _commit(self, b: CheckedBatch, cfg: PlanConfig, half: int, buf: np.ndarray,
                offsets: dict[str, int], num_qo_heads: int, num_kv_heads: int,
                dims: HeadDims) -> None:
        """Make the staged plan the current one: what run() and inspection read."""
        tiles = cfg.tiles
        self.tiles, self.layout, self._offsets = tiles, cfg.layout, offsets
        self._stager.commit(half, buf)
        self._plan = _LazyPlan((b.qo, b.kv_lens, num_qo_heads, num_kv_heads, tiles.tq,
                                tiles.num_ctas), cfg.kwargs)
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.head_dim_vo, self._width = dims.qk, dims.vo, dims.width
        self.page_size, self.page_shift, self._max_page = b.page, b.shift, b.max_page
        self.qo_indptr, self.kv_lens = b.qo, b.kv_lens
        self._has_kv_pos, self._has_q_pos = b.kvoff is not None, b.qpos is not None
    def _checked_fast(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any,
                      kv_last_page_len: Any, num_qo_heads: Any, num_kv_heads: Any,
                      head_dim: Any, page_size: Any, q_dtype: Any, kv8: torch.dtype | None = None
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
                                                       page, q_dtype, kv8):
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
            code, checked = bp.plan(qo, kvp, pages, last, ps, cfg.problem, memo[1][0], buf,
                                    offsets)
            # (staged with the last tiles; a batch crossing LONG_KV_KEYS re-stages with its own)
            if code == planner.STAGED and long_kv_batch(checked[1]) == memo[1][1]:
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
                    head_dim: int, q_dtype: Any, kv8: torch.dtype | None = None) -> _Staged:
        """Batch `b`'s config, and its plan and tables written to the next staging half: by the
        compiled planner when its checks passed `b` (`fast`), else -- or when the layout cannot
        hold the plan -- with numpy (the same words, or the error scheduler.plan raises).
        Returns (config, staging half, its numpy view, table offsets, whether planner.c
        staged it)."""
        cfg = self._config(b, num_qo_heads, num_kv_heads, head_dim, q_dtype, kv8)
        tiles, layout = cfg.tiles, cfg.layout
        half, buf, offsets = self._staging_for(layout)
        if fast and self._planner.plan_and_stage(cfg.problem, buf, offsets):
            return cfg, half, buf, offsets, True
        scheduler.plan_into(buf[:layout.size], layout, b.qo, b.kv_lens, num_qo_heads,
                            num_kv_heads, tiles.tq, tiles.num_ctas, **cfg.kwargs, checked=fast)
        stage_tables(buf, b, offsets)
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
        their tensors clamped (docs/semantics.md), and the bindings with the clamps' sizes
        (`reads.SafeReads`). With explicit q_positions / kv_position_offset every read is
        clamped."""
        return self._safe(ir, bindings, self.kv_lens,
                          positions_unknown=self._has_q_pos or self._has_kv_pos,
                          num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, head_dim_vo=self.head_dim_vo)

    def _variant_ir(self) -> VariantIR:
        """The variant's traced IR, for plan()'s checks (traced once; run() traces again for the
        captured values of that call)."""
        if self._ir is None:
            self._ir = self.variant.trace()[0]
        return self._ir

    def _causal_bound(self) -> int | None:
        """`causal.mask_causal_bound` of the variant (None: no mask, or no bound its structure
        proves); computed once."""
        if self._kv_bound is False:
            self._kv_bound = mask_causal_bound(self._variant_ir())
        return self._kv_bound  # type: ignore[return-value]

    def _fa3_mode(self, group: int, head_dim: int, page_size: int,
                  q_dtype: torch.dtype, kv8: torch.dtype | None = None) -> str:
        """choose_batch_tiles' `fa3` (`tiles.fa3_mode`), with fa3_unsupported's answer
        memoised per batch shape: plan() runs every step."""
        if self.kernel == "fa2" or (self.kernel is None and self._forced_tiles is not None) \
                or self._padded_plan:  # (runs on the FA2 kernels)
            return "off"
        key = (group, head_dim, page_size, q_dtype, kv8)
        why = self._fa3_why.get(key, False)
        if why is False:
            why = self._fa3_why[key] = fa3_unsupported(
                self.device, head_dim=head_dim, group=group, kv_layout=self.kv_layout,
                page_size=page_size, q_dtype=q_dtype, kv_dtype=kv8)
        return fa3_mode(self.kernel, self._forced_tiles, why)

    def _config_key(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page: int,
                    q_dtype: Any, kv8: torch.dtype | None = None) -> tuple:
        """What a plan's config depends on besides its batch's longest query: the arguments
        and every knob `_config` reads (a knob changed between plans is honoured)."""
        return (head_dim, num_qo_heads, num_kv_heads, page, q_dtype, kv8, self.kernel, self.tiles,
                self._planner, self.min_kv_chunk, self.max_batch, self.max_qo_tokens,
                self.max_pages, self.kv_layout, self._forced_tiles, self.balance,
                self._tree_plan, self._padded_plan)

    def _config(self, b: CheckedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                q_dtype: Any, kv8: torch.dtype | None = None) -> PlanConfig:
        """The tiles, layout and scheduler arguments of batch `b` (`tiles.plan_config`): the
        last ones again when everything they depend on is the last call's (a serving loop's
        every step: a decode batch is the same shape step after step)."""
        key = self._config_key(num_qo_heads, num_kv_heads, head_dim, b.page, q_dtype, kv8)
        memo = self._last_config
        shape = (b.max_q_len, long_kv_batch(b.kv_lens))
        if memo is not None and memo[0] == key and memo[1] == shape:
            return memo[2]
        group = num_qo_heads // num_kv_heads
        fa3 = self._fa3_mode(group, head_dim, b.page, q_dtype, kv8)
        tiles = self._tiles_for(head_dim, b.max_q_len * group, fa3, shape[1])
        cfg = plan_config(tiles, b.qo, b.kv_lens, num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, max_batch=self.max_batch,
                          max_qo_tokens=self.max_qo_tokens, balance=self.balance,
                          min_kv_chunk=self.min_kv_chunk, compiled=bool(self._planner))
        if self.balance:  # (without it the grid depends on the whole batch: nothing to keep)
            self._last_config = (key, shape, cfg)
        return cfg

    def _tiles_for(self, head_dim: int, max_fused_rows: int, fa3: str = "off",
                   long_kv: bool = False) -> BatchTiles:
        """`choose_batch_tiles` for this device, keeping the current kernel's tiles when the
        new batch fits them (`tiles.keep_captured_tiles`) and a captured run's pipeline depth
        (`tiles.keep_captured_depth`)."""
        forced = tuple(self._forced_tiles) if self._forced_tiles is not None else None
        tiles = batch_tiles(head_dim, max_fused_rows, num_sms(self.device), forced, fa3, long_kv,
                            pair_form_runs(self._variant_ir()), self._tree_plan)
        tiles = keep_captured_tiles(self.tiles, tiles, fa3, self._tree_plan)
        return keep_captured_depth(self._captured.tiles if self._captured else None, tiles)

    # ------------------------------------------------------------------------------ staging
    def workspace_bytes(self) -> int:
        """Bytes of workspace the current plan's layout needs (plan, page tables, partials)."""
        if self.layout is None:
            raise RuntimeError("call plan() first: the workspace size depends on the layout")
        return 4 * self._int_words() + scheduler.workspace_bytes(
            self.layout, self._width, self.num_qo_heads, 4)

    def _int_words(self, layout: scheduler.PlanLayout | None = None) -> int:
        """int32 words of the plan (`layout`, default the current one) and the page tables."""
        lay = layout if layout is not None else self.layout
        assert lay is not None
        return int_words(lay, self.max_batch, self.max_qo_tokens, self.max_pages)

    def _table_offsets(self, layout: scheduler.PlanLayout) -> dict[str, int]:
        """Word offsets of the page tables after `layout`'s plan (`staging.table_offsets`)."""
        return table_offsets(layout, self.max_batch, self.max_qo_tokens)

    def _staging_for(self, layout: scheduler.PlanLayout
                     ) -> tuple[int, np.ndarray, dict[str, int]]:
        """The staging half the next plan writes, its numpy view and the page tables' word
        offsets after `layout`'s plan (`staging.Staging`: resized only for another layout;
        waits only for the copy of the plan before last)."""
        st = self._stager
        if layout is not st.layout:
            st.fit(layout, self._int_words(layout), self._table_offsets(layout), self._uploader,
                   pinned=self.device.type == "cuda")
        return st.take(self._uploader)

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
            self._uploader = Uploader(self.device)
        half = self._stager.half
        self._uploader.copy(ws.data_ptr(), self._stager.halves_at[half], half, ranges)

    def _workspace_for(self, used: int) -> torch.Tensor:
        """The workspace, allocated at the first plan, checked to hold the current layout's
        plan, tables and partials; not checked again while the workspace, layout and head dim
        are the last check's and the `used` words lie within the int32 words it checked."""
        ws, lay = self.workspace, self.layout
        last = self._ws_checked
        if ws is not None and ws is last[0] and lay is last[1] and self._width == last[2] \
                and used <= last[3]:
            return ws
        need = self.workspace_bytes()
        if ws is None or ws.numel() < need:
            if ws is not None and not self._own_workspace:
                raise ValueError(f"workspace_buffer has {ws.numel()} bytes; this layout "
                                 f"needs {need} (BatchAttention.workspace_bytes())")
            if ws is not None and self._graph_captured:
                raise ValueError(
                    f"this plan's layout needs {need} bytes of workspace and the one "
                    f"BatchAttention allocated holds {ws.numel()}; a CUDA graph captured run() "
                    f"with that buffer, so it cannot grow: pass workspace_buffer= (a uint8 "
                    f"tensor of at least {need} bytes) or plan the largest batch before "
                    f"capturing")
            if ws is not None:  # kernels on any stream may still read the old buffer
                torch.cuda.synchronize(self.device)
            ws = self.workspace = torch.empty(need, dtype=torch.uint8, device=self.device)
        if ws.dtype != torch.uint8 or ws.device != self.device:
            raise ValueError("workspace_buffer must be a uint8 tensor on the kernel's device")
        self._ws_checked = (ws, lay, self._width, self._int_words())
        return ws

    def kernel_record(self) -> KernelRecord | None:
        """The kernel cache's record (ptxas's spill bytes, the driver's local bytes, registers,
        recompiles) of the batch kernel the last run() launched; None before the first run."""
        kern = getattr(self, "_last_kernel", None)
        return kern.record if kern is not None else None

    # ------------------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, kv_cache: Any, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False,
            scale: float | None = None, sinks: torch.Tensor | None = None,
            k_scale: Any = None, v_scale: Any = None) -> Any:
        """Attention of the planned batch: `out [total_q, num_qo_heads, head_dim]` (and `lse
        [total_q, num_qo_heads]` float32 with `return_lse`). CUDA-graph capturable once the
        kernels are compiled (call run once before capturing); replays use the latest plan,
        and a later plan the captured kernel cannot run raises in plan() (capture.py).
        Under torch.compile: one `attncc::batch_attention_run` call (ops.py); on a CPU plan:
        the float64 reference (`_reference_run`).
        `q` may have more rows than the plan's `total_q` (a static buffer a graph captures
        once): only the plan's rows are read, and `out` / `lse` have q's rows. `sinks`
        [num_qo_heads] (float32 or q's dtype): attention-sink logits joined once to each row's
        denominator (in the epilogue, or the merge of a split row); the LSE includes them
        (docs/serving.md, "Attention sinks"). A captured graph reads the sinks' memory at each
        replay (a float32 tensor is read in place, so updates to it are seen). An fp8 cache
        (plan(kv_data_type=...)) stands for `k8 * k_scale`, `v8 * v_scale`: a float or a tensor
        [num_kv_heads] each, default 1 (docs/serving.md, "fp8 KV cache")."""
        if torch.compiler.is_compiling():  # one op call in the graph (docs/compile.md)
            if out is not None or lse is not None:
                raise ValueError("BatchAttention.run under torch.compile makes its own out / "
                                 "lse; drop out= and lse= (the compiler manages buffers)")
            from .ops import compiled_run

            return compiled_run(self, q, kv_cache, return_lse, scale, sinks, k_scale, v_scale)
        if self._plan is None or self.tiles is None or self.layout is None:
            raise RuntimeError("call plan() before run()")
        if self.device.type != "cuda":  # a CPU plan: the exact result (no kernel)
            return self._reference_run(q, kv_cache, out, lse, return_lse, scale, sinks,
                                       k_scale, v_scale)
        shape = self._planned_shape()
        k, v, strides = cache_views(kv_cache, shape)
        check_q(q, int(self.qo_indptr[-1]), shape)
        check_kv_dtype(q, k, v, self.kv_data_type)
        ir, bindings = self._safe_reads(*self.variant.trace())
        self._check_run_hooks(ir, return_lse or lse is not None)
        scales = self._scales.pointers(k_scale, v_scale, self.num_kv_heads, self.kv_data_type,
                                       self.device)
        sinks32 = self._sinks_operand(sinks, q, ir)
        kern = self._last_kernel = _kernels_for(
            ir, self._width, "bfloat16" if q.dtype == torch.bfloat16 else "float16",
            self.tiles, self.device.index or 0, self.kv_data_type, self._padded_plan)
        out = check_out(out, q, self.head_dim_vo)
        lse = check_lse(lse, return_lse, q, self.device)
        params = self._launch_args(q, k, v, out, lse, strides, scale)
        if sinks32 is not None:
            params["sinks"] = sinks32.data_ptr()
        params["k_scale"], params["v_scale"] = scales
        if torch.cuda.is_current_stream_capturing():
            self._note_capture()
        self._launch(kern, params, bindings)
        return (out, lse) if return_lse else out

    def _note_capture(self) -> None:
        """run() is being captured in a CUDA graph: its workspace cannot grow, and later plans
        must keep what its kernels and launch arguments fixed (`_check_captured`)."""
        self._graph_captured = self._graph_captured or self._own_workspace
        self._fa3_captured = self._fa3_captured or (self.tiles.kernel == "fa3"
                                                    and self.tiles.tq == 128)
        self._captured = self._launch_shape(
            self.tiles, self.layout, self._offsets, (self.num_qo_heads, self.num_kv_heads),
            (self.head_dim, self.head_dim_vo), self.page_size, self.kv_data_type,
            (self._has_q_pos, self._has_kv_pos), self.kv_lens)

    def _launch_shape(self, tiles: BatchTiles, layout: Any, offsets: dict, heads: tuple,
                      head_dims: tuple[int, int], page_size: int, kv8: torch.dtype | None,
                      positions: tuple[bool, bool], kv_lens: np.ndarray) -> LaunchShape:
        """What a graph capturing a run of this plan fixes (`capture.LaunchShape`); `head_dims`
        the real (Dqk, Dv)."""
        ir, bindings = self.variant.trace()
        reads = self._safe.signature(ir, bindings, kv_lens, positions_unknown=any(positions),
                                     num_qo_heads=heads[0], num_kv_heads=heads[1],
                                     head_dim=head_dims[0], head_dim_vo=head_dims[1])
        return LaunchShape(heads, head_dims, page_size, kv8, positions, tiles, layout,
                           tuple(sorted(offsets.items())), reads)

    def _check_captured(self, cfg: PlanConfig, offsets: dict, b: CheckedBatch,
                        heads: tuple[int, int], head_dims: tuple[int, int],
                        kv8: torch.dtype | None) -> None:
        """After run() was captured in a CUDA graph, a plan that the captured kernels and launch
        arguments cannot run raises here, before it becomes current (`capture.py`)."""
        if self._captured is None:
            return
        new = self._launch_shape(cfg.tiles, cfg.layout, offsets, heads, head_dims, b.page, kv8,
                                 (b.qpos is not None, b.kvoff is not None), b.kv_lens)
        why = capture_mismatch(self._captured, new)
        if why is not None:
            raise ValueError(
                f"a CUDA graph captured run() on an earlier plan, and this plan changes {why}: "
                f"its replays would run the captured kernel with the captured arguments on a "
                f"plan they cannot run. Keep later plans within the capture (query rows per "
                f"request that fit the captured tiles; the same heads, head_dim, page_size and "
                f"kv_data_type), capture on the largest step's plan, or give each captured "
                f"graph its own BatchAttention (as FlashInfer's use_cuda_graph wrappers)")

    def _check_run_hooks(self, ir: VariantIR, want_lse: bool) -> None:
        """What run() refuses of the variant with this plan: key/value mods on an fp8 cache,
        an LSE without a softmax."""
        if self.kv_data_type is not None and ("key_mod" in ir.hooks or "value_mod" in ir.hooks):
            raise ValueError("an fp8 KV cache holds keys and values already transformed "
                             "(append_paged_kv_cache(key_mod=...)): read it with a variant "
                             "without key_mod / value_mod")
        if not ir.use_softmax and want_lse:
            raise ValueError("return_lse=True but the variant has normalize='none'")

    def _reference_run(self, q: torch.Tensor, kv_cache: Any, out: torch.Tensor | None,
                       lse: torch.Tensor | None, return_lse: bool, scale: float | None,
                       sinks: torch.Tensor | None, k_scale: Any, v_scale: Any) -> Any:
        """run() of a CPU plan (BatchAttention(device="cpu")): the float64 reference
        `batch_attention_reference` of the planned batch (fp8 cache, sinks and tree mask
        included), after run()'s own checks, written as run() writes: out in q's dtype, lse
        float32, rows past the plan's zero (lse -inf). What torch.compile'd code runs on the
        CPU too (attncc::batch_attention_run)."""
        shape = self._planned_shape()
        k, v, _ = cache_views(kv_cache, shape)
        n = int(self.qo_indptr[-1])
        check_q(q, n, shape)
        check_kv_dtype(q, k, v, self.kv_data_type)
        ir = self.variant.trace()[0]
        self._check_run_hooks(ir, return_lse or lse is not None)
        sinks = self._sinks_operand(sinks, q, ir)  # (checked, float32)
        out, lse = check_out(out, q), check_lse(lse, return_lse, q, self.device)
        qo, kvp, pages, last, mask, packed, qpos, kvoff = self._host_batch
        ref, ref_lse = batch_attention_reference(
            q[:n], (k, v), qo, kvp, pages, last, kv_layout=self.kv_layout,
            page_size=1 if self.kv_layout == "ragged" else self.page_size, variant=self.variant,
            scale=scale, sinks=sinks, custom_mask=mask, packed_custom_mask=packed,
            k_scale=k_scale, v_scale=v_scale, q_positions=qpos, kv_position_offset=kvoff)
        out[:n], out[n:] = ref, 0
        if lse is not None:
            lse[:n], lse[n:] = (ref_lse if ref_lse is not None else 0), -math.inf
        return (out, lse) if return_lse else out

    def _sinks_operand(self, sinks: Any, q: torch.Tensor, ir: VariantIR) -> torch.Tensor | None:
        """The kernels' float32 sinks, checked (reference.check_sinks); kept on the instance so
        that a converted copy lives as long as a graph that captured its address."""
        if sinks is None:
            return None
        if not ir.use_softmax:
            raise InvalidArgument("sinks were given but the variant has normalize='none': a "
                                  "sink joins a softmax denominator; drop sinks")
        check_sinks(sinks, self.num_qo_heads, self.device, q.dtype)
        s32 = sinks.detach().to(torch.float32).contiguous()
        # a copy is kept; the caller's own float32 tensor is not (under torch.compile's
        # CUDA graphs it lives in the graph's pool, which must hold no untracked tensor)
        self._sinks32 = s32 if s32.data_ptr() != sinks.data_ptr() else None
        return s32

    def _planned_shape(self) -> PlannedShape:
        """What the current plan fixes about run()'s tensors (`operands`)."""
        return PlannedShape(self.kv_layout, self.device, self.num_qo_heads, self.num_kv_heads,
                            self.head_dim, self.page_size, self._max_page, self.head_dim_vo)

    def _launch_args(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor | None,
                     strides: tuple[int, int, int], scale: float | None) -> dict[str, Any]:
        """The BatchParams of this plan's kernel kind (`launch`): the FA3 batch kernel's, the
        decode form's (FA2 with KV warps) or the FA2 batch kernel's."""
        ws, lay = self.workspace, self.layout
        assert ws is not None and lay is not None and self.tiles is not None
        pointers = launch.workspace_pointers(
            ws.data_ptr(), self._int_words(), lay, self._offsets, head_dim=self._width,
            q_positions=self._has_q_pos, kv_positions=self._has_kv_pos)
        # always the table's address: a graph captured now replays later plans' masks
        pointers["tree_mask"] = self._tree.device.data_ptr() if self._tree is not None else 0
        shape = dict(num_kv_heads=self.num_kv_heads, page_size=self.page_size,
                     page_shift=self.page_shift,
                     sm_scale=1.0 / math.sqrt(self.head_dim) if scale is None else float(scale))
        if self.tiles.kernel == "fa3":
            return launch.fa3_batch_args(pointers, q, k, v, out, lse, strides, tiles=self.tiles,
                                         **shape)
        build = launch.decode_args if self.tiles.kv_warps > 1 else launch.fa2_batch_args
        return build(pointers, q, k, v, out, lse, strides, **shape)

    def _launch(self, kern: Any, params: dict[str, Any], bindings: Bindings) -> None:
        """The attention kernel over the plan, then the merge of its split items (if the layout
        has room for any) on the current stream. `kern`: what `_kernels_for` returns (the
        attend and merge kernels, their config and simplified IR)."""
        from attncc.codegen.generate import variant_param_values

        cap = captured(kern.ir, bindings, self.device)
        vp = variant_param_values(kern.launcher.vp.layout, cap["scalars"], cap["tensors"])
        stream = current_raw_stream(self.device.index)
        lay = self.layout
        assert lay is not None
        launch.launch_attention(kern, params, vp, lay, stream)
        if lay.max_merges:  # the split items' merge
            grid = launch.merge_grid(lay, num_sms(self.device))
            launch.launch_merge(kern, params, vp, grid, stream, self._pdl)
