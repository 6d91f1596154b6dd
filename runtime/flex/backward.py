"""The backward launch (kernels/fa2/fa2_backward.cuh, and kernels/fa3/fa3_backward.cuh on sm_90):
which template runs, the block mask's KV-major lists, BackwardParams, the captured tensors' fp32
gradient buffers, and the launch.

`run_backward` takes what the forward saved (materialized q/k/v, the output and its LSE) and
the output's gradient, and returns dq, dk, dv and the gradients of the captured tensors named in
`grad_tensors`. docs/backward.md, "Kernels" and "The FA3-class kernel", is the design note.

Example (the KV-major lists need no GPU):
    >>> import torch
    >>> num = torch.tensor([[[1, 2]]], dtype=torch.int32)          # q block 0: kv 0; 1: kv 0, 1
    >>> idx = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    >>> qn, qi, _, _ = kv_major_lists(num, idx, None, None, n_kv_blocks=3)
    >>> qn.tolist(), qi[0, 0, :, :].tolist()
    ([[[2, 1, 0]]], [[0, 1], [1, 0], [0, 0]])
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from attncc.codegen.constants import BWD_DQ_THREADS, BWD_ROWS_THREADS
from attncc.codegen.cuda_expr import to_f32
from attncc.codegen.tiles import (FA3_BACKWARD_TILES, BackwardTiles, backward_fallbacks,
                                  backward_tiles)
from attncc.errors import InvalidArgument
from attncc.ir.program import Bindings, VariantIR

from ..jit.kernels import KernelSpec, get_kernel, loaded_generation
from ..jit.launch_args import captured
from ..jit.device import capability
from ..jit.launcher import current_raw_stream
from ..jit.tma import MapCache, MapSlot
from .block_mask import kv_major_blocks
from .exact_grad import exact_grad_buffer, exact_grad_strides, exact_grad_value

__all__ = ["kv_major_lists", "BackwardResult", "run_backward", "backward_kernel",
           "backward_spec", "backward_head_dims_why", "kv_head_chunk", "backward_grid"]

BACKWARD_KERNELS = ("fa2", "fa3")


def _padded(q_num: torch.Tensor, q_idx: torch.Tensor, n_kv_blocks: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists with a row for every KV block a CTA can own: a mask narrower than the keys lists
    nothing for the blocks past its width (the forward skips them too)."""
    extra = n_kv_blocks - q_num.shape[-1]
    if extra <= 0:
        return q_num, q_idx
    return (torch.nn.functional.pad(q_num, (0, extra)),
            torch.nn.functional.pad(q_idx, (0, 0, 0, extra)))


def kv_major_lists(num: torch.Tensor, idx: torch.Tensor, fnum: torch.Tensor | None,
                   fidx: torch.Tensor | None, n_kv_blocks: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The launch's (possibly folded: gpu_flex._mask_args) Q-major lists transposed for the
    backward (block_mask.kv_major_blocks), partial and full, with a row per KV block of the keys.
    """
    qn, qi = _padded(*kv_major_blocks(num, idx), n_kv_blocks)
    if fnum is None:
        return qn, qi, None, None
    fqn, fqi = _padded(*kv_major_blocks(fnum, fidx), n_kv_blocks)
    return qn, qi, fqn, fqi


class _Lru:
    """A bounded, thread-safe map that forgets its least recently used entry first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: "OrderedDict[tuple, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, key: tuple) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def store(self, key: tuple, entry: Any) -> None:
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get_or_make(self, key: tuple, make: Any) -> Any:
        """The entry of `key`, made by `make()` and stored on a miss."""
        hit = self.lookup(key)
        if hit is None:
            hit = make()
            self.store(key, hit)
        return hit


class _ListsMemo(_Lru):
    """The KV-major lists of the last few block masks a backward ran (`kv_major_lists` is about
    twenty small torch launches a call, host time that a training step repeats for every layer
    and step). Keyed by the list tensors themselves, which an entry holds, so an id is never
    reused while cached, by their version counters, so a list changed in place misses, and by
    the stream the lists were made on (another stream is not ordered after their making).
    Nothing made during a CUDA graph capture is kept: its values exist only when the graph
    replays."""

    def get(self, lists: tuple[torch.Tensor | None, ...], n_kv_blocks: int) -> tuple:
        cuda = lists[0].is_cuda
        stream = current_raw_stream(lists[0].device.index) if cuda else 0
        key = (*((id(t), t._version) if t is not None else None for t in lists), n_kv_blocks,
               stream)
        hit = self.lookup(key)
        if hit is not None:
            return hit[1]
        value = kv_major_lists(*lists, n_kv_blocks)
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            self.store(key, (lists, value))
        return value


_LISTS = _ListsMemo(8)


def _bstrides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(0 if s == 1 else st for s, st in zip(t.shape, t.stride()))


@dataclass
class BackwardResult:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    captured: dict[str, torch.Tensor]  # gradient of each captured tensor named in grad_tensors


def _mask_params(mask: Any, tiles: BackwardTiles, kv_len: int) -> tuple[dict[str, Any], tuple]:
    """BackwardParams' block-mask members (all 0 without a mask) and the lists they point to."""
    zero = {"q_num_blocks": 0, "q_indices": 0, "full_q_num_blocks": 0, "full_q_indices": 0,
            "qm_stride_b": 0, "qm_stride_h": 0, "qi_stride_b": 0, "qi_stride_h": 0,
            "qi_stride_kv": 0, "block_q": 0, "block_kv": 0}
    if mask is None:
        return zero, ()
    if mask.block_kv % tiles.tkv or mask.block_q % tiles.tq:
        raise InvalidArgument(f"block_mask has BLOCK_SIZE ({mask.block_q}, {mask.block_kv}); the "
                              f"GPU backward needs multiples of ({tiles.tq}, {tiles.tkv}): "
                              f"create the block mask with BLOCK_SIZE=128")
    n_kvb = -(-kv_len // mask.block_kv)
    qn, qi, fqn, fqi = _LISTS.get((mask.num, mask.idx, mask.fnum, mask.fidx), n_kvb)
    nb, ix = _bstrides(qn), _bstrides(qi)
    zero.update(q_num_blocks=qn.data_ptr(), q_indices=qi.data_ptr(),
                full_q_num_blocks=fqn.data_ptr() if fqn is not None else 0,
                full_q_indices=fqi.data_ptr() if fqi is not None else 0,
                qm_stride_b=nb[0], qm_stride_h=nb[1], qi_stride_b=ix[0], qi_stride_h=ix[1],
                qi_stride_kv=qi.stride(2), block_q=mask.block_q, block_kv=mask.block_kv)
    return zero, (qn, qi, fqn, fqi)


def backward_head_dims_why(head_dim: int, head_dim_vo: int) -> str | None:
    """Why the GPU backward cannot run these (query/key, value) head dims, None when it can:
    its kernels take 64, 128 and 256 with one head dim for q, k and v (the forward's padded
    form has no backward; docs/backward.md, "Head dims").

    Example:
        >>> backward_head_dims_why(128, 128) is None, backward_head_dims_why(96, 96)[:35]
        (True, 'the GPU backward runs head dims 64,')
    """
    if head_dim == head_dim_vo and head_dim in (64, 128, 256):
        return None
    return (f"the GPU backward runs head dims 64, 128 and 256 with one head dim for q, k and v, "
            f"not {head_dim}/{head_dim_vo} (q/k, v), which the forward runs padded; call it "
            f"without gradients (torch.no_grad() or detached inputs), or use head dim 64, 128 "
            f"or 256")


def _fa3_fits(head_dim: int, mask: Any) -> str | None:
    """Why the FA3-class kernel cannot run this backward (None: it can)."""
    t = FA3_BACKWARD_TILES
    if head_dim not in (64, 128):
        return f"head dim {head_dim} (it runs 64 and 128)"
    if mask is not None and (mask.block_kv % t.tkv or mask.block_q % t.tq):
        return (f"block_mask BLOCK_SIZE ({mask.block_q}, {mask.block_kv}) (it needs multiples "
                f"of ({t.tq}, {t.tkv}))")
    return None


def backward_kernel(choice: str | None, head_dim: int, mask: Any, sm90: bool) -> str:
    """"fa2" or "fa3": the backward kernel kernel_options['BACKWARD_KERNEL'] (`choice`) asks for,
    or by default FA3 on sm_90 where it fits (docs/backward.md, "The FA3-class kernel").

    Example:
        >>> backward_kernel(None, 128, None, sm90=True), backward_kernel(None, 256, None, True)
        ('fa3', 'fa2')
        >>> backward_kernel("fa2", 128, None, sm90=True)
        'fa2'
    """
    if choice is not None and choice not in BACKWARD_KERNELS:
        raise InvalidArgument(f"kernel_options['BACKWARD_KERNEL']={choice!r}: use 'fa2' or "
                              f"'fa3', or leave it out (attncc picks)")
    why = _fa3_fits(head_dim, mask) if sm90 else "a GPU other than sm_90 (H100/H200)"
    if choice == "fa3" and why is not None:
        raise InvalidArgument(f"kernel_options['BACKWARD_KERNEL']='fa3' cannot run {why}; use "
                              f"'fa2' or leave BACKWARD_KERNEL out")
    if choice is not None:
        return choice
    return "fa3" if why is None else "fa2"


def backward_spec(kind: str, ir: VariantIR, head_dim: int, dtype: str, mask: Any, *,
                  fast_math: bool, device: int | None,
                  grad_tensors: Sequence[str], exact_grads: bool = False) -> KernelSpec:
    """The kernel cache's spec: FA3's one form with the FA2-class forms as its fallbacks (a
    variant whose FA3-class form spills runs FA2), or the FA2-class forms alone. `exact_grads`
    (the deterministic mode, with captured gradients): their exact-sum form."""
    exact = exact_grads and bool(grad_tensors)
    forms = backward_fallbacks(head_dim, mask.block_kv if mask is not None else None)
    if not forms:  # the FA2-class first form's message (BLOCK_SIZE=128)
        _mask_params(mask, backward_tiles(head_dim), 0)
    if kind == "fa3":
        forms = tuple(f for f in forms if mask is None or mask.block_q % f.tq == 0)
        return KernelSpec("fa3_backward", ir=ir, head_dim=head_dim, dtype=dtype,
                          tiles=FA3_BACKWARD_TILES, fast_math=fast_math, device=device,
                          grad_tensors=tuple(grad_tensors), fallbacks=forms, exact_grads=exact)
    return KernelSpec("fa2_backward", ir=ir, head_dim=head_dim, dtype=dtype, tiles=forms[0],
                      fast_math=fast_math, device=device, grad_tensors=tuple(grad_tensors),
                      fallbacks=forms[1:], exact_grads=exact)


def kv_head_chunk(num_kv_heads: int) -> int:
    """C, the number of KV heads a backward grid takes together (fa2_backward.cuh `bwd_cta`:
    grid (n_tiles C, num_kv_heads / C, batch), x = KV tile * C + head of the chunk): 4 when it
    divides num_kv_heads, else 2 when that does, else 1.

    Why: CTAs launch in x order, and a causal mask gives KV tile 0 the most query tiles. With
    one head per y the last head's longest CTA starts after every other head's tiles and ends
    last; interleaving C heads starts the chunk's longest tiles first (longest-first within a
    chunk). Chunks rather than all heads at once: the CTAs running together then read the Q and
    dO of C heads (times the GQA group), which stay in L2.

    Example:
        >>> [kv_head_chunk(h) for h in (1, 2, 3, 6, 8, 16)]
        [1, 2, 1, 2, 4, 4]
    """
    return 4 if num_kv_heads % 4 == 0 else 2 if num_kv_heads % 2 == 0 else 1


def backward_grid(n_tiles: int, num_kv_heads: int, batch: int) -> tuple[int, int, int]:
    """The backward kernels' grid for `n_tiles` KV tiles per head (kv_head_chunk's order); the
    deterministic mode launches it with n_tiles = 1 once per tile (BackwardParams.kv_tile0).

    Example:
        >>> backward_grid(16, 8, 2), backward_grid(1, 6, 1)
        ((64, 2, 2), (2, 3, 1))
    """
    c = kv_head_chunk(num_kv_heads)
    return n_tiles * c, num_kv_heads // c, batch


def _strides(prefix: str, t: torch.Tensor) -> dict[str, int]:
    return {f"{prefix}_stride_b": t.stride(0), f"{prefix}_stride_h": t.stride(1),
            f"{prefix}_stride_s": t.stride(2)}


def _rows_16b(t: torch.Tensor) -> bool:
    """Whether `t`'s rows take 16-byte loads: a contiguous, 16-byte aligned head dim and row
    strides in multiples of 8 elements."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s in t.stride()[:-1]))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` with rows the 16-byte loads take (`_rows_16b`)."""
    return t if _plain(t) or _rows_16b(t) else t.contiguous()


def _plain(t: torch.Tensor) -> bool:
    """Whether `t` is [B, H, S, D] with the row-major strides of its shape (size-1 dims too,
    which `is_contiguous` does not check), a 16-byte aligned start and D a multiple of 8: then
    `_dense` and `_tma_strided` return it unchanged at once, without their per-dim checks
    (the common call)."""
    if t.dim() != 4:
        return False
    _, h, s, d = t.shape
    return t.stride() == (h * s * d, s * d, d, 1) and d % 8 == 0 and t.data_ptr() % 16 == 0


class _KernelMemo(_Lru):
    """The loaded backward kernel of the last few (variant IR, form) pairs a backward ran:
    building its `KernelSpec` and the kernel cache's lookup are tens of microseconds of host
    time every training step repeats for every layer. Keyed by the IR object's id, the kernel
    cache's generation (`loaded_generation`: it forgets with the cache) and the form's
    arguments; an entry holds the IR, so no other object can have its id while it is cached."""

    def get(self, ir: VariantIR, args: tuple, make: Any) -> Any:
        return self.get_or_make((id(ir), loaded_generation(), *args), lambda: (ir, make()))[1]


_KERNELS = _KernelMemo(32)


def _backward_kernel(kernel: str | None, ir: VariantIR, head_dim: int, dtype: str, mask: Any,
                     *, fast_math: bool, device: int, grad_tensors: Sequence[str],
                     deterministic: bool) -> Any:
    """The loaded kernel `run_backward` launches (the kernel cache's; memoized by `_KERNELS`)."""
    blocks = (mask.block_q, mask.block_kv) if mask is not None else None

    def make() -> Any:
        kind = backward_kernel(kernel, head_dim, mask, capability(device) == (9, 0))
        return get_kernel(backward_spec(kind, ir, head_dim, dtype, mask, fast_math=fast_math,
                                        device=device, grad_tensors=grad_tensors,
                                        exact_grads=deterministic))
    return _KERNELS.get(ir, (kernel, head_dim, dtype, blocks, fast_math, device,
                             tuple(grad_tensors), deterministic), make)


def run_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor | None, dout: torch.Tensor,
                 dlse: torch.Tensor | None, ir: VariantIR, bindings: Bindings, mask: Any, *,
                 scale: float, grad_tensors: Sequence[str] = (), device: int,
                 fast_math: bool = True, deterministic: bool = False,
                 kernel: str | None = None) -> BackwardResult:
    """dq, dk, dv (and captured gradients) of attention `ir` (no q/k/v/output transforms; its
    mask_mod already merged with the block mask's, `mask` the forward's lists: gpu_flex's plan).
    `lse` is the forward's (None for normalize none); `dlse` the LSE's gradient or None.
    `deterministic`: one launch per KV tile, in order, so every dQ element takes at most one
    atomic add per launch and the sum's order is fixed, and captured gradients summed exactly
    (exact_grad.py), so no order matters (docs/backward.md, "Deterministic mode").
    `kernel`: kernel_options['BACKWARD_KERNEL'] ("fa2", "fa3" or None: chosen)."""
    B, Hq, Sq, D = query.shape
    Hkv, Skv = key.shape[1], key.shape[2]
    if 0 in (B, Hq, Sq, Skv):  # nothing attends to anything: every gradient is 0, no launch
        return BackwardResult(torch.zeros_like(query), torch.zeros_like(key),
                              torch.zeros_like(value),
                              {n: torch.zeros_like(bindings.tensors[n]) for n in grad_tensors})
    dtype = "bfloat16" if query.dtype == torch.bfloat16 else "float16"
    kern = _backward_kernel(kernel, ir, D, dtype, mask, fast_math=fast_math, device=device,
                            grad_tensors=grad_tensors, deterministic=deterministic)
    # the form the kernel cache compiled (an FA3 spec may have fallen back to an FA2 form)
    tiles = kern.spec.tiles
    mvals, keep = _mask_params(mask, tiles, Skv)
    tkv = kern.config.tkv
    dev = query.device
    fa3 = kern.spec.kind == "fa3_backward"
    q, k, v, do = (_dense(t) for t in (query, key, value, dout))
    dk = torch.empty(key.shape, dtype=key.dtype, device=dev)
    dv = torch.empty(value.shape, dtype=value.dtype, device=dev)
    delta = None
    lse_h = Sq  # the LSE's (and delta's) stride between heads
    if lse is not None and not fa3:  # softmax: delta = rowsum(dO * O) - dLSE (docs/backward.md)
        lse = lse.contiguous()
        delta = (do.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - dlse.float()
        delta = delta.contiguous()
    if fa3:  # the FA3-class kernel's inputs (BackwardParams::tma)
        # (held until the launch: a copy made here must outlive it)
        q, k, v, do = (_tma_strided(t) for t in (q, k, v, do))
        rows = -(-Sq // FA3_BACKWARD_TILES.tq) * FA3_BACKWARD_TILES.tq
        if lse is not None:
            lse, lse_h = _fa3_rows(do, _dense(out), lse, dlse, rows, dtype, dev), 2 * rows
        dq_acc = torch.zeros(B, Hq, rows * D, dtype=torch.float32, device=dev)
        dq_strides = {"dq_stride_b": Hq * rows * D, "dq_stride_h": rows * D, "dq_stride_s": D}
    else:
        dq_acc = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=dev)
        dq_strides = _strides("dq", dq_acc)
    shapes = {n: bindings.tensors[n].shape for n in grad_tensors}
    bufs = ({n: exact_grad_buffer(s, dev) for n, s in shapes.items()} if deterministic else
            {n: torch.zeros(s, dtype=torch.float32, device=dev) for n, s in shapes.items()})
    args = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "dout": do.data_ptr(),
            "lse": lse.data_ptr() if lse is not None else 0,
            "delta": delta.data_ptr() if delta is not None else 0,
            "dq_accum": dq_acc.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr(),
            **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("do", do),
            **dq_strides, **_strides("dk", dk), **_strides("dv", dv),
            "lse_stride_b": Hq * lse_h, "lse_stride_h": lse_h,
            "batch": B, "num_q_heads": Hq, "num_kv_heads": Hkv, "q_len": Sq, "kv_len": Skv,
            "sm_scale": scale, "sm_scale_log2": scale_log2(scale), **mvals, "kv_tile0": 0,
            "tma": _fa3_maps(q, k, v, do).data_ptr() if fa3 else 0}
    n_tiles = -(-Skv // tkv)
    if deterministic:
        for t in range(n_tiles):
            _launch(kern, {**args, "kv_tile0": t}, ir, bindings, bufs, dev,
                    backward_grid(1, Hkv, B))
    else:
        _launch(kern, args, ir, bindings, bufs, dev, backward_grid(n_tiles, Hkv, B))
    del keep  # the lists stay alive until the launch is enqueued
    # on each tensor's own device: a captured CPU tensor's kernel reads a device copy
    grads = {n: (exact_grad_value(b) if deterministic else b).to(
        device=bindings.tensors[n].device, dtype=bindings.tensors[n].dtype)
        for n, b in bufs.items()}
    dq = fa3_dq(dq_acc, Sq, D, query.dtype, scale) if fa3 else dq_acc.to(query.dtype)
    return BackwardResult(dq, dk, dv, grads)


def scale_log2(scale: float) -> float:
    """sm_scale * log2(e) as the kernels' float arithmetic rounds it (fp32 operands, one
    rounding of their exact product): the factor the forward's exp2 applies, which the
    backward recomputes P with (BackwardParams::sm_scale_log2).

    Example:
        >>> scale_log2(0.125) == 0.125 * 1.4426950216293335
        True
    """
    return to_f32(to_f32(scale) * to_f32(math.log2(math.e)))


_BWD_MAPS = MapCache(16)  # the FA3-class backward's q, k, v, dO maps (runtime/jit/tma.py)


def _fa3_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> MapSlot:
    """The q, k, v, dO tensor maps of the FA3-class backward (fa3_backward.cuh `tmap`): each
    over [batch, heads, seq, head_dim] as strided (positive strides: `_tma_strided`), in
    [64 rows][64] boxes, so a box's rows past the sequence are outside the tensor and load as
    zeros."""
    from ..jit.tma import encode_map

    ts = (q, k, v, do)
    return _BWD_MAPS.get(tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in ts),
                         q.device, lambda: b"".join(encode_map(t, (1, 1, 64, 64)) for t in ts))


def _tma_strided(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor map can describe it: a positive stride in every dim. A broadcast dim
    (stride 0, as an expanded output gradient has) is copied out; a size-1 dim's stride, never
    stepped, is set to the extent of the dims inside it.

    Example:
        >>> x = torch.zeros(1, 64, 8).expand(2, 64, 8)
        >>> _tma_strided(x).stride(), _tma_strided(torch.zeros(64, 8)[None]).stride()
        ((512, 8, 1), (512, 8, 1))
    """
    if _plain(t):
        return t
    if any(st == 0 and n > 1 for n, st in zip(t.shape[:-1], t.stride()[:-1])):
        t = t.contiguous()
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:  # (the only dims a zero stride is left on)
            strides[i] = strides[i + 1] * t.shape[i + 1]
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides)


def _fa3_rows(do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
              rows: int, dtype: str, dev: torch.device) -> torch.Tensor:
    """The LSE and delta as the FA3-class kernel's one bulk copy a tile reads them, made by the
    row kernel (kernels/small/bwd_rows.cuh) in one launch: [B, Hq, rows / 64, 2, 64], each
    64-row query tile's LSE (base 2; +inf for a row with no weight, so its P is 0, never NaN)
    then its delta = rowsum(dO * O) - dLSE in fp32, rows padded to whole tiles (+inf and 0).
    `do` and `out` have 16-byte aligned rows (`_dense`)."""
    B, H, S = lse.shape
    D = do.shape[-1]
    if D % 8 or (D // 8) & (D // 8 - 1) or D > 256:
        raise InvalidArgument(f"the FA3-class backward's row kernel takes head dims 8 x a power "
                              f"of two up to 256, not {D}")
    for name, t in (("dout", do), ("out", out)):
        if not _rows_16b(t):
            raise InvalidArgument(f"{name}: the row kernel reads 16-byte aligned rows; pass it "
                                  f"through _dense first")
    tq = FA3_BACKWARD_TILES.tq
    buf = torch.empty((B, H, rows // tq, 2, tq), dtype=torch.float32, device=dev)
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.float()
    dl = dlse if dlse is not None else lse  # (strides only: the pointer is null)
    params = {"dout": do.data_ptr(), "out": out.data_ptr(), "lse": lse.data_ptr(),
              "dlse": dlse.data_ptr() if dlse is not None else 0, "rows": buf.data_ptr(),
              **{f"{n}_stride_{d}": t.stride(i) for n, t in (("do", do), ("o", out))
                 for i, d in enumerate("bhs")},
              **{f"{n}_stride_{d}": t.stride(i) for n, t in (("lse", lse), ("dlse", dl))
                 for i, d in enumerate("bhs")},
              "batch": B, "heads": H, "q_len": S, "tiles": rows // tq, "head_dim": D}
    kl = _small_kernel("bwd_rows", dtype, dev.index).launcher
    rows_per_block = BWD_ROWS_THREADS // (D // 8)
    kl.launch((-(-B * H * rows // rows_per_block), 1, 1), (BWD_ROWS_THREADS, 1, 1), 0,
              kl.ap.flatten(params), (), stream=current_raw_stream(dev.index))
    return buf


_SMALL = _Lru(16)


def _small_kernel(kind: str, dtype: str, device: int | None) -> Any:
    """The row or dQ conversion kernel (no variant: one per dtype and device), loaded once per
    `loaded_generation`."""
    return _SMALL.get_or_make((kind, dtype, device, loaded_generation()),
                             lambda: get_kernel(KernelSpec(kind, dtype=dtype, device=device)))


def fa3_dq(acc: torch.Tensor, q_len: int, head_dim: int, dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    """dQ [B, Hq, q_len, head_dim] in `dtype`: `scale` (the attention's sm_scale, which the
    kernel leaves out of its sums) times the FA3-class kernel's dq_accum [B, Hq, rows *
    head_dim] (fp32), where each 64-row query tile is head_dim / 64 staging tiles of [8][128 threads][4]
    (fa3_backward.cuh `stage_dq`), element 4 j + 2 hr + i of thread 32 wi + 4 r + a at row
    16 wi + 8 hr + r and column 64 g + 8 j + 2 a + i. On CUDA one launch of the dQ conversion
    (kernels/small/bwd_dq.cuh) for bf16 / fp16; otherwise (and as that layout's definition) one
    strided torch copy.

    Example:
        >>> import torch
        >>> dq = torch.arange(64 * 64.).view(64, 64)
        >>> t = dq.view(4, 2, 8, 1, 8, 4, 2).permute(3, 4, 0, 2, 5, 1, 6)  # staging order
        >>> torch.equal(fa3_dq(t.reshape(1, 1, -1), 64, 64, torch.float32)[0, 0], dq)
        True
    """
    if acc.is_cuda and dtype in (torch.bfloat16, torch.float16):
        return _dq_kernel(acc, q_len, head_dim, dtype, scale)
    B, H = acc.shape[:2]
    g = head_dim // 64
    tiles = acc.shape[2] // (64 * head_dim)
    out = torch.empty(B, H, tiles * 64, head_dim, dtype=dtype, device=acc.device)
    # out's dims as b, h, tile, wi, hr, r, g, j, a, i, permuted to the staging order
    out.view(B, H, tiles, 4, 2, 8, g, 8, 4, 2).permute(0, 1, 2, 6, 7, 3, 5, 8, 4, 9).copy_(
        acc.view(B, H, tiles, g, 8, 4, 8, 4, 2, 2) * scale)
    return out[:, :, :q_len]


def _dq_kernel(acc: torch.Tensor, q_len: int, head_dim: int, dtype: torch.dtype,
               scale: float) -> torch.Tensor:
    """`fa3_dq` by the dQ conversion kernel: one CTA per 64 x 64 block of dQ."""
    B, H = acc.shape[:2]
    tiles = acc.shape[2] // (64 * head_dim)
    if not acc.is_contiguous():
        raise InvalidArgument("dq_accum: the dQ conversion reads a contiguous accumulator")
    dq = torch.empty(B, H, q_len, head_dim, dtype=dtype, device=acc.device)
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    kl = _small_kernel("bwd_dq", name, acc.device.index).launcher
    params = {"acc": acc.data_ptr(), "dq": dq.data_ptr(),
              **{f"dq_stride_{d}": dq.stride(i) for i, d in enumerate("bhs")},
              "heads": H, "q_len": q_len, "tiles": tiles, "groups": head_dim // 64,
              "scale": float(scale)}
    kl.launch((B * H * tiles * (head_dim // 64), 1, 1), (BWD_DQ_THREADS, 1, 1), 0,
              kl.ap.flatten(params), (), stream=current_raw_stream(acc.device.index))
    return dq


def _launch(kern: Any, args: Mapping[str, Any], ir: VariantIR, bindings: Bindings,
            bufs: Mapping[str, torch.Tensor], dev: torch.device,
            grid: tuple[int, int, int]) -> None:
    """Pack BackwardParams, the captured values and the gradient buffers; launch on torch's
    current stream."""
    from attncc.codegen.generate import variant_param_values
    from attncc.codegen.layout import variant_grad_values

    kl, cfg = kern.launcher, kern.config
    values = captured(ir, bindings, dev)
    vp = variant_param_values(kl.vp.layout, values["scalars"], values["tensors"])
    gp = variant_grad_values(kl.gp.layout, {
        n: (b.data_ptr(), exact_grad_strides(b) if b.dtype == torch.int64 else list(b.stride()))
        for n, b in bufs.items()})
    kl.launch(grid, (cfg.threads, 1, 1), cfg.smem_bytes, kl.ap.flatten(args), kl.vp.flatten(vp),
              stream=current_raw_stream(dev.index), gp_flat=kl.gp.flatten(gp))


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale the forward used: `scale`, or 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
