"""The exact attention oracle: a variant's IR evaluated with torch on upcast inputs.

`attention_reference` is what `attncc.flex_attention` runs on CPU tensors, and what GPU tests
compare compiled kernels against. It evaluates every hook with `attncc.ir.evaluator.evaluate`
(float64 by default) on whatever device the inputs live on, chunked over query rows so that the
score matrix of a long sequence never has to exist at once.

Semantics (the same ones the kernel templates implement, see docs/kernel-interface.md):

1. `q' = query_mod(q)`, `k' = key_mod(k)`, `v' = value_mod(v)` (the key/value hooks see the kv
   head as `h`);
2. `score = (q' . k') * scale` (default `1/sqrt(D)`), then `score_mod`;
3. a position is kept when the variant's `mask_mod` keeps it AND the block mask keeps it
   (FlexAttention rules: absent blocks are masked, partial blocks apply `block_mask.mask_mod`,
   full blocks are kept);
4. `normalize="softmax"`: softmax over kept keys; a row with no kept key (or whose every kept
   score is -inf) gives output 0 and LSE -inf. `normalize="none"`: `out = sum(score * v)` over
   kept keys, no LSE. NaN and inf propagate as in torch (a NaN score: NaN row and LSE; a +inf
   score: NaN row, LSE +inf); a masked key is never read, not even its value row
   (docs/semantics.md, "NaN and inf");
5. `output_mod` on every output row (a fully masked row's output is 0 before `output_mod`).

GQA: query head `h` reads kv head `h // (Hq // Hkv)`.

`batch_attention_reference` is the same oracle for a serving batch (paged or ragged KV caches),
request by request: what `BatchAttention.run` is tested against, with `BatchAttention.plan`'s
argument checks (`serving.plan.checks`).

Example:
    >>> import torch
    >>> from attncc.frontend import Variant
    >>> ir, bind = Variant(mask_mod=lambda b, h, q, kv: q >= kv).trace()
    >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    >>> out, lse = attention_reference(q, k, v, ir, bind)
    >>> out.dtype, tuple(out.shape), tuple(lse.shape)
    (torch.float64, (1, 2, 5, 8), (1, 2, 5))
    >>> bool(torch.allclose(out[0, 0, 0], v[0, 0, 0].double()))   # row 0 sees only key 0
    True
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch

from attncc.errors import InvalidArgument, InvalidArgumentType, TraceError
from attncc.frontend import Variant
from attncc.ir.analysis import CapturedReadError, bounds_message, load_guards
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import Node
from attncc.ir.program import Bindings, VariantIR

from .kv8 import FP8_KV_DTYPES, dequantize, kv_scale
from .serving.plan.checks import CheckedBatch, check_batch, np_int

# Elements of one [B, H, rows, Skv] intermediate when q_chunk is chosen automatically: the
# evaluator keeps a handful of such buffers alive per hook, so 2**22 float64 elements (32 MiB)
# keeps a 4096x4096 problem to a few hundred MiB on a CPU.
_AUTO_CHUNK_ELEMS = 1 << 22

# torch marks its "no block mask" BlockMask with this block size (and seq_lengths (1, 1)).
_TORCH_NOOP_BLOCK = 1 << 30

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIX_READ = "make the tensor longer or mask that position"


# --------------------------------------------------------------------------------- validation
def validate_attention_inputs(query: Any, key: Any, value: Any, block_mask: Any = None,
                              enable_gqa: bool = False) -> None:
    """Check shapes, dtypes, devices and the block mask; messages name the offending argument.

    Example:
        >>> q = torch.randn(1, 4, 8, 16); kv = torch.randn(1, 2, 8, 16)
        >>> validate_attention_inputs(q, kv, kv, enable_gqa=True)
        >>> try:
        ...     validate_attention_inputs(q, kv, kv)
        ... except ValueError as e:
        ...     print(str(e).split(";")[0])
        query has 4 heads but key/value have 2
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq_len, head_dim], got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use float16, bfloat16, float32 or "
                             f"float64")
        if t.is_nested:
            raise ValueError(f"{name} is a nested tensor; pass a dense [B, H, S, D] tensor")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must share a dtype, got query={query.dtype}, "
                         f"key={key.dtype}, value={value.dtype}; convert them with .to(dtype)")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device, got query={query.device}, "
                         f"key={key.device}, value={value.device}")
    B, Hq, Sq, D = query.shape
    Bk, Hkv, Skv, Dk = key.shape
    Bv, Hv, Sv, _ = value.shape
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: query has {B}, key {Bk}, value {Bv}")
    if Dk != D:
        raise ValueError(f"key head_dim {Dk} != query head_dim {D}: query and key must share "
                         f"the last dim (value's may differ)")
    if Hv != Hkv or Sv != Skv:
        raise ValueError(f"value has {Hv} heads and seq_len {Sv} but key has {Hkv} heads and "
                         f"seq_len {Skv}; they must match")
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(f"query has {Hq} heads but key/value have {Hkv}; pass "
                             f"enable_gqa=True for grouped-query attention")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"enable_gqa=True needs query heads ({Hq}) to be a multiple of "
                             f"key/value heads ({Hkv})")
    if block_mask is not None:
        _validate_block_mask(block_mask, B, Hq, Sq, Skv, query.device)


def block_size(block_mask: Any) -> tuple[int, int]:
    bs = block_mask.BLOCK_SIZE
    if isinstance(bs, int):
        return bs, bs
    bq, bkv = tuple(bs)
    return int(bq), int(bkv)


def _validate_block_mask(bm: Any, B: int, Hq: int, Sq: int, Skv: int,
                         device: torch.device) -> None:
    for attr in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE"):
        if not hasattr(bm, attr):
            raise TypeError(f"block_mask must be a BlockMask (attncc.create_block_mask or "
                            f"torch's create_block_mask); {type(bm).__name__} has no .{attr}")
    bq, bkv = block_size(bm)
    if bq <= 0 or bkv <= 0:
        raise ValueError(f"block_mask.BLOCK_SIZE must be positive, got {(bq, bkv)}")
    num, idx = bm.kv_num_blocks, bm.kv_indices
    if num.dim() != 3 or idx.dim() != 4:
        raise ValueError(f"block_mask.kv_num_blocks must be [B, H, q_blocks] and kv_indices "
                         f"[B, H, q_blocks, kv_blocks], got {tuple(num.shape)} and "
                         f"{tuple(idx.shape)}")
    if num.device != device:
        raise ValueError(f"block_mask is on {num.device} but query is on {device}; create it "
                         f"with device=query.device or move it with block_mask.to(device)")
    Bm, Hm, nqb = num.shape
    if Bm not in (1, B):
        raise ValueError(f"block_mask has batch size {Bm} but query has {B}; create it with "
                         f"B={B} or B=None")
    if Hm not in (1, Hq):
        raise ValueError(f"block_mask has {Hm} heads but query has {Hq}; create it with "
                         f"H={Hq} or H=None")
    noop = bq >= _TORCH_NOOP_BLOCK and bkv >= _TORCH_NOOP_BLOCK
    seq = getattr(bm, "seq_lengths", None)
    if seq is not None and not noop and tuple(int(s) for s in seq) != (Sq, Skv):
        raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN)={tuple(seq)} but query "
                         f"has seq_len {Sq} and key {Skv}; create the block mask with "
                         f"Q_LEN={Sq}, KV_LEN={Skv}")
    if nqb * bq < Sq:
        raise ValueError(f"block_mask covers {nqb} query blocks of {bq} rows ({nqb * bq} rows) "
                         f"but query has seq_len {Sq}; create it with Q_LEN={Sq}")
    full = getattr(bm, "full_kv_num_blocks", None)
    if full is not None and tuple(full.shape) != tuple(num.shape):
        raise ValueError(f"block_mask.full_kv_num_blocks has shape {tuple(full.shape)}, not "
                         f"kv_num_blocks' {tuple(num.shape)}")


# --------------------------------------------------------------------------------- sinks
def check_sinks(sinks: Any, num_heads: int, device: torch.device, dtype: torch.dtype) -> None:
    """The attention-sink argument (docs/flex-api.md, "Attention sinks"): a finite float
    tensor [num_heads] on the queries' device, float32 or the queries' dtype. The finiteness
    check reads the values back, so it is skipped while a CUDA graph is being captured.

    Example:
        >>> check_sinks(torch.zeros(4), 4, torch.device("cpu"), torch.bfloat16)
        >>> try:
        ...     check_sinks(torch.zeros(2), 4, torch.device("cpu"), torch.float32)
        ... except InvalidArgument as e:
        ...     print(str(e).split(";")[0])
        sinks has shape (2,)
    """
    if not isinstance(sinks, torch.Tensor):
        raise InvalidArgumentType(f"sinks must be a torch.Tensor [{num_heads}] of per-head sink "
                                  f"logits (or None), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_heads,):
        raise InvalidArgument(f"sinks has shape {tuple(sinks.shape)}; it must be [{num_heads}]: "
                              f"one sink logit per query head")
    if sinks.dtype not in (torch.float32, dtype):
        raise InvalidArgument(f"sinks has dtype {sinks.dtype}; use float32 or the queries' "
                              f"dtype {dtype} (sinks.float())")
    if sinks.device != device:
        raise InvalidArgument(f"sinks is on {sinks.device} but the queries are on {device}; "
                              f"move it with sinks.to({str(device)!r})")
    capturing = sinks.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool(torch.isfinite(sinks).all()):
        raise InvalidArgument("sinks holds a NaN or an infinity; every sink logit must be "
                              "finite (leave sinks=None for attention without sinks)")


def add_sink(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A finished attention state `(o [..., D], lse [...])` with the sink logit `sink`
    (broadcast to lse's shape) joined to its softmax denominator: the sink is one more key with
    no value, so `lse' = logaddexp(lse, sink)` and `o' = exp(lse - lse') o`. An empty state
    (lse -inf) gives o' = 0 and lse' = sink; NaN and +inf propagate as in the merge.
    Differentiable (torch ops; the weight is computed from the smaller exponent, never
    overflowing).

    Example:
        >>> o, lse = add_sink(torch.ones(1, 2), torch.zeros(1), torch.zeros(1))
        >>> o.tolist(), round(float(lse), 6) == round(math.log(2), 6)
        ([[0.5, 0.5]], True)
        >>> add_sink(torch.ones(1, 1), torch.tensor([-math.inf]), torch.tensor([1.5]))
        (tensor([[0.]]), tensor([1.5000]))
    """
    sink = sink.to(lse.dtype).expand(lse.shape)
    new = torch.logaddexp(lse, sink)
    empty = torch.isneginf(lse)
    w = torch.exp(torch.where(empty, torch.zeros_like(lse), lse) - new)  # <= 1: lse <= new
    zero = torch.zeros((), dtype=o.dtype, device=o.device)
    return torch.where(empty.unsqueeze(-1), zero, o * w.unsqueeze(-1).to(o.dtype)), new


# --------------------------------------------------------------------------------- block masks
def is_noop_mask(fn: Any) -> bool:
    """torch's and attncc's `noop_mask` keep everything (torch's cannot be traced: new_ones)."""
    if fn is None:
        return True
    from attncc.frontend import noop_mask

    if fn is noop_mask:
        return True
    try:
        from torch.nn.attention.flex_attention import noop_mask as torch_noop
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return False
    return fn is torch_noop


def block_states(bm: Any, Skv: int, device: torch.device) -> torch.Tensor:
    """[Bm, Hm, q_blocks, kv_blocks] int8: 0 = absent (masked), 1 = partial, 2 = full."""
    _, bkv = block_size(bm)
    nkvb = max(1, -(-Skv // bkv))
    num = bm.kv_num_blocks.to(device=device, dtype=torch.long)
    Bm, Hm, nqb = num.shape
    # column nkvb collects padding entries (beyond num_blocks, or pointing past the sequence)
    state = torch.zeros(Bm, Hm, nqb, nkvb + 1, dtype=torch.int8, device=device)
    lists = [(num, bm.kv_indices, 1)]
    if getattr(bm, "full_kv_num_blocks", None) is not None and \
            getattr(bm, "full_kv_indices", None) is not None:
        lists.append((bm.full_kv_num_blocks.to(device=device, dtype=torch.long),
                      bm.full_kv_indices, 2))
    for counts, indices, code in lists:
        ind = indices.to(device=device, dtype=torch.long)
        slot = torch.arange(ind.shape[-1], device=device)
        used = slot < counts[..., None]
        ok = used & (ind >= 0) & (ind < nkvb)
        col = torch.where(ok, ind, torch.full_like(ind, nkvb))
        # full wins over partial: a block listed as full is kept without its mask_mod
        state.scatter_reduce_(-1, col, torch.full_like(col, code, dtype=torch.int8), "amax")
    return state[..., :nkvb]


def trace_mask(fn: Callable) -> tuple[VariantIR, Bindings]:
    from attncc.frontend import trace_mods

    try:
        from torch.nn.attention.flex_attention import _sliced_mask_mod_error
    except ImportError:  # pragma: no cover
        _sliced_mask_mod_error = None
    if _sliced_mask_mod_error is not None and fn is _sliced_mask_mod_error:
        raise ValueError("block_mask was sliced, so its mask_mod is gone; create the block mask "
                         "for the shape you use instead of slicing it")
    return trace_mods({"mask_mod": fn})


# --------------------------------------------------------------------------------- evaluation
def _device_tensors(bindings: Bindings, device: torch.device) -> dict[str, torch.Tensor]:
    """Captured tensors on `device`: CPU ones are copied over, ones on another GPU are an error."""
    out = {}
    for name, t in bindings.tensors.items():
        if t.device != device:
            if t.device.type != "cpu":
                raise TraceError(f"captured tensor {name!r} is on {t.device} but the attention "
                                 f"inputs are on {device}; move it with {name} = "
                                 f"{name}.to({str(device)!r}) before defining the mod")
            t = t.to(device)
        out[name] = t
    return out


def _index(n: int, dim: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = n
    return torch.arange(offset, offset + n, device=device).view(shape)


class _Hooks:
    """Evaluates one traced variant's hooks with its bindings on one device."""

    def __init__(self, ir: VariantIR, bindings: Bindings, device: torch.device,
                 float_dtype: torch.dtype) -> None:
        self.ir = ir
        self.params = dict(bindings.scalars)
        self.tensors = _device_tensors(bindings, device)
        self.float_dtype = float_dtype
        self.reads: list = []  # out-of-range captured reads of the last call (see check)

    def active(self, hook: str) -> Node | None:
        """The hook's expression, or None when it is the identity (nothing to evaluate)."""
        h = self.ir.hook(hook)
        return None if h.is_identity else h.expr

    def __call__(self, expr: Node, env: Mapping[str, Any]) -> torch.Tensor:
        """`expr` on `env`. Captured reads outside their tensor are clamped (never an error here)
        and kept in `self.reads` as (load, out-of-range positions it really reads, indices) for
        `check`: whether such a position counts depends on the mask (torch accepts
        `table[q_idx - kv_idx]` under a causal mask)."""
        oob: dict[int, tuple] = {}
        r = evaluate(expr, env, self.tensors, self.params, self.float_dtype, oob=oob)
        self.reads = self._guarded(expr, env, oob) if oob else []
        return r

    def _guarded(self, expr: Node, env: Mapping[str, Any], oob: dict[int, tuple]) -> list:
        """The out-of-range reads the generated code really makes: a load under `where` / `&` /
        `|` counts only where its guard holds (C evaluates it lazily)."""
        guards = load_guards(expr)
        out = []
        for node, bad, flat in oob.values():
            g = guards[id(node)][1]
            if g.op != "const":
                bad = bad & evaluate(g, env, self.tensors, self.params, self.float_dtype,
                                     oob={}).bool()
            elif not g.attr:
                continue
            out.append((node, bad, flat))
        return out

    def check(self, hook: str, reads: list, env: Mapping[str, Any],
              counts: torch.Tensor | None = None, fix: str = _FIX_READ) -> None:
        """Raise CapturedReadError for the first read in `reads` outside its tensor at a position
        where `counts` holds (None: everywhere), naming the hook's line and that position."""
        for node, bad, flat in reads:
            hit = bad if counts is None else bad & counts
            if not bool(hit.any()):
                continue
            names = [n for n in ("b", "h", "q_idx", "kv_idx", "d") if isinstance(env.get(n),
                                                                                  torch.Tensor)]
            full = torch.broadcast_shapes(hit.shape, *(env[n].shape for n in names))
            pos = tuple(hit.expand(full).nonzero()[0].tolist())
            where = {n: int(env[n].expand(full)[pos]) for n in names}
            t = self.tensors[node.attr]
            for dim, i in enumerate(flat):
                value = int(i.expand(full)[pos])
                if not 0 <= value < t.shape[dim]:
                    break
            raise CapturedReadError(bounds_message(hook, self.ir.hook(hook).source, node, dim,
                                                   value, t.shape[dim], where, fix))


def _transform(hooks: _Hooks, hook: str, vec_name: str, x: torch.Tensor, pos_name: str,
               offset: int = 0, b_offset: int = 0) -> torch.Tensor:
    """query/key/value/output_mod on a [B, H, S, D] tensor (identity when the hook is absent)."""
    expr = hooks.active(hook)
    if expr is None:
        return x
    B, H, S, D = x.shape
    dev = x.device
    env = {vec_name: x, "b": _index(B, 0, dev, b_offset), "h": _index(H, 1, dev),
           pos_name: _index(S, 2, dev, offset), "d": _index(D, 3, dev)}
    r = hooks(expr, env).expand(B, H, S, D)
    hooks.check(hook, hooks.reads, env)
    return r


def _auto_chunk(B: int, Hq: int, Skv: int) -> int:
    return max(1, _AUTO_CHUNK_ELEMS // max(1, B * Hq * Skv))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: VariantIR,
                        bindings: Bindings | None = None, *, block_mask: Any = None,
                        scale: float | None = None, enable_gqa: bool = False,
                        float_dtype: torch.dtype = torch.float64, q_chunk: int | None = None,
                        q_offset: int = 0, b_offset: int = 0,
                        stats: dict[str, torch.Tensor] | None = None,
                        sinks: torch.Tensor | None = None,
                        keep_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact attention for a traced variant: `(out [B,Hq,Sq,Dv], lse [B,Hq,Sq] or None)`.

    Both results are `float_dtype` on the inputs' device. `lse` (natural log, FlexAttention's
    convention) is None for `normalize="none"`. `q_chunk` bounds memory: query rows are processed
    that many at a time (None: chosen so one [B, H, rows, Skv] buffer is ~4M elements); results
    agree across chunk sizes to float64 rounding (BLAS may pick another kernel for a 1-row
    matmul). `block_mask` is an attncc or torch BlockMask. `q_offset`: query row r is position
    `q_offset + r` for the hooks and the block mask (serving: the queries are the last tokens of
    a longer sequence). `b_offset`: batch row r is batch index `b_offset + r` for the hooks
    (serving: one request at a time, and the hooks' b is the request). `stats`, a dict, receives
    "max": each row's max modified score over the kept keys (-inf for a fully masked row),
    float_dtype [B, Hq, Sq] (FlexAttention's `max_scores`). `sinks` [Hq] (`check_sinks`): each
    head's sink logit joins the softmax denominator with no value (gpt-oss's attention sinks);
    the LSE then includes it, and a fully masked row gives output 0 and LSE = the sink. The
    result is differentiable in `sinks` too.
    `keep_mask`, a bool [Sq, Skv] tensor, is ANDed with the variant's mask (serving's custom /
    tree masks).

    Example:
        >>> import torch
        >>> from attncc.frontend import Variant
        >>> ir, bind = Variant(score_mod=lambda s, b, h, q, kv: s * 0).trace()
        >>> q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
        >>> out, lse = attention_reference(q, k, v, ir, bind)    # uniform weights: mean of v
        >>> bool(torch.allclose(out[0, 0, 2], v[0, 0].double().mean(0)))
        True
        >>> round(float(lse[0, 0, 0]), 6) == round(math.log(3), 6)
        True
    """
    validate_attention_inputs(q, k, v, block_mask, enable_gqa)
    if q_chunk is not None and q_chunk < 1:
        raise ValueError(f"q_chunk must be a positive number of query rows, got {q_chunk}")
    bindings = bindings if bindings is not None else Bindings()
    device = q.device
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    hooks = _Hooks(ir, bindings, device, float_dtype)
    sink_rows = None
    if sinks is not None:
        if not ir.use_softmax:
            raise InvalidArgument("sinks were given but the variant has normalize='none': a "
                                  "sink joins a softmax denominator; drop sinks")
        check_sinks(sinks, Hq, device, q.dtype)
        sink_rows = sinks.to(float_dtype).view(1, Hq, 1, 1)

    for name, off in (("q_offset", q_offset), ("b_offset", b_offset)):
        if not isinstance(off, int) or off < 0:
            raise ValueError(f"{name} must be a non-negative int, got {off!r}")
    qf = _transform(hooks, "query_mod", "q", q.to(float_dtype), "q_idx", q_offset, b_offset)
    kf = _transform(hooks, "key_mod", "k", k.to(float_dtype), "kv_idx", 0, b_offset)
    vf = _transform(hooks, "value_mod", "v", v.to(float_dtype), "kv_idx", 0, b_offset)
    # GQA without copying k/v: query heads grouped as [B, Hkv, G, ...]; h = hkv * G + g
    # contiguous K^T: MKL then computes a row's dot products the same way for (almost) any
    # chunk height, so results barely depend on q_chunk
    kT = kf.transpose(-1, -2).contiguous().unsqueeze(2)  # [B, Hkv, 1, D, Skv]
    vg = vf.unsqueeze(2)  # [B, Hkv, 1, Skv, Dv]

    score_expr = hooks.active("score_mod")
    mask_expr = hooks.active("mask_mod")
    bm_state = bm_hooks = bm_expr = None
    if block_mask is not None:
        bq, bkv = block_size(block_mask)
        bm_state = block_states(block_mask, Skv, device)
        if not is_noop_mask(getattr(block_mask, "mask_mod", None)):
            # the torch.library op passes the mask already traced (flex/ops.py)
            traced = getattr(block_mask, "traced_mask", None)
            bm_ir, bm_bind = traced if traced is not None else trace_mask(block_mask.mask_mod)
            bm_hooks = _Hooks(bm_ir, bm_bind, device, float_dtype)
            bm_expr = bm_hooks.active("mask_mod")
        kv_block = torch.arange(Skv, device=device) // bkv

    out = torch.empty(B, Hq, Sq, Dv, dtype=float_dtype, device=device)
    lse = torch.empty(B, Hq, Sq, dtype=float_dtype, device=device) if ir.use_softmax else None
    if stats is not None:
        stats["max"] = torch.full((B, Hq, Sq), -math.inf, dtype=float_dtype, device=device)
    chunk = q_chunk or _auto_chunk(B, Hq, Skv)
    b_idx, h_idx = _index(B, 0, device, b_offset), _index(Hq, 1, device)
    kv_idx = _index(Skv, 3, device)
    for r0 in range(0, Sq, chunk):
        r1 = min(Sq, r0 + chunk)
        rows = r1 - r0
        shape = (B, Hq, rows, Skv)
        qc = qf[:, :, r0:r1].reshape(B, Hkv, G, rows, D)
        s = (qc @ kT).reshape(shape) * scale
        q_idx = _index(rows, 2, device, q_offset + r0)
        env = {"score": s, "b": b_idx, "h": h_idx, "q_idx": q_idx, "kv_idx": kv_idx}
        score_reads: list = []
        if score_expr is not None:
            s = hooks(score_expr, env).expand(shape)
            score_reads = hooks.reads
        keep: torch.Tensor | None = None
        if mask_expr is not None:
            keep = hooks(mask_expr, env)
            hooks.check("mask_mod", hooks.reads, env)
        if bm_state is not None:
            st = bm_state[:, :, (torch.arange(q_offset + r0, q_offset + r1, device=device) // bq)
                          ][..., kv_block]
            kept = st == 2
            if bm_expr is not None:
                kept = kept | ((st == 1) & bm_hooks(bm_expr, env))  # type: ignore[misc]
                bm_hooks.check("mask_mod", bm_hooks.reads, env, st == 1)  # type: ignore[union-attr]
            else:
                kept = kept | (st == 1)
            keep = kept if keep is None else keep & kept
        if keep_mask is not None:
            kept = keep_mask[r0:r1].to(device)
            keep = kept if keep is None else keep & kept
        if keep is not None:
            keep = keep.expand(shape)
        # a score_mod read outside its tensor counts only where the mask keeps the position
        hooks.check("score_mod", score_reads, env, keep)
        if stats is not None and Skv > 0:
            kept_s = s if keep is None else s.masked_fill(~keep, -math.inf)
            stats["max"][:, :, r0:r1] = kept_s.amax(-1)
        if ir.use_softmax:
            if keep is not None:
                s = s.masked_fill(~keep, -math.inf)
            o, lse_rows = _softmax_rows(s, keep, vg, (B, Hkv, G, rows), sink_rows)
            lse[:, :, r0:r1] = lse_rows  # type: ignore[index]
        else:
            w = s if keep is None else torch.where(keep, s, 0)
            o = _kept_matmul(w, keep, vg, (B, Hkv, G, rows))
        out[:, :, r0:r1] = _transform(hooks, "output_mod", "o", o, "q_idx", q_offset + r0,
                                      b_offset)
    return out, lse


# --------------------------------------------------------------------------------- softmax
def _softmax_rows(s: torch.Tensor, keep: torch.Tensor | None, vg: torch.Tensor,
                  groups: tuple[int, int, int, int], sink: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted values and LSE of score rows `s` [B, Hq, rows, Skv] (masked = -inf).

    NaN and inf follow torch: a NaN score makes its row's output and LSE NaN, a +inf score
    makes the output NaN and the LSE +inf; a row whose every score is -inf (masked, or -inf
    from score_mod) has no weight at all and gives output 0 and LSE -inf. `sink` [1, Hq, 1, 1]
    (finite) is one more logit per row with no value: in the max and the denominator only.
    """
    B, Hq, rows, Skv = s.shape
    if Skv == 0:
        m = s.new_full((B, Hq, rows, 1), -math.inf)
    else:
        m = s.amax(-1, keepdim=True)  # NaN when the row holds a NaN score
    if sink is not None:
        m = torch.maximum(m, sink)  # NaN stays NaN
    # a fully masked row has max -inf: shift by 0 so exp gives 0 rather than NaN
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)  # NaN for a NaN max, and at a +inf score (inf - inf)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m_safe)  # never 0: the sink is finite
    empty = denom == 0  # every score -inf: exactly the rows with no weight
    o = _kept_matmul(p, keep, vg, groups)
    o = torch.where(empty, 0, o / torch.where(empty, 1, denom))
    lse = torch.where(m == math.inf, m, m_safe + torch.log(denom))  # logsumexp with a +inf is +inf
    return o, lse.squeeze(-1)


def _kept_matmul(w: torch.Tensor, keep: torch.Tensor | None, vg: torch.Tensor,
                 groups: tuple[int, int, int, int]) -> torch.Tensor:
    """`sum over kept keys of w * v` per row: [B, Hq, rows, Dv] from w [B, Hq, rows, Skv].

    A masked key is never read: a NaN or inf in its value row changes nothing (a plain w @ v
    would turn 0 * NaN into NaN in every row). Kept keys multiply as IEEE does (0 * inf is NaN).

    Example:
        >>> w = torch.tensor([[[[0.5, 0.0]]]], dtype=torch.float64)
        >>> v = torch.tensor([[[[[2.0], [float("nan")]]]]], dtype=torch.float64)
        >>> _kept_matmul(w, torch.tensor([[[[True, False]]]]), v, (1, 1, 1, 1)).tolist()
        [[[[1.0]]]]
        >>> _kept_matmul(w, None, v, (1, 1, 1, 1)).isnan().item()
        True
    """
    B, Hkv, G, rows = groups
    Hq, Skv, Dv = w.shape[1], w.shape[-1], vg.shape[-1]
    w5 = w.reshape(B, Hkv, G, rows, Skv)
    bad = ~torch.isfinite(vg).all(-1)  # [B, Hkv, 1, Skv]: keys whose value row is not finite
    if keep is None or not bool(bad.any()):
        return (w5 @ vg).reshape(B, Hq, rows, Dv)
    # the finite keys by one matmul; each non-finite value row (few in practice) added with
    # IEEE products for the rows that keep it
    vfin = torch.where(bad.unsqueeze(-1), 0, vg)
    o = (torch.where(bad.unsqueeze(-2), 0, w5) @ vfin).reshape(B, Hq, rows, Dv)
    cols = bad.reshape(B, Hkv, Skv).any(0).any(0).nonzero().flatten()
    step = max(1, _AUTO_CHUNK_ELEMS // max(1, B * Hq * rows * Dv))
    for c0 in range(0, cols.numel(), step):
        c = cols[c0:c0 + step]
        wk = w5.index_select(-1, c).unsqueeze(-1)  # [B, Hkv, G, rows, n, 1]
        kk = keep.reshape(B, Hkv, G, rows, Skv).index_select(-1, c).unsqueeze(-1)
        kk = kk & bad.index_select(-1, c).reshape(B, Hkv, 1, 1, -1, 1)  # the rest is in o
        vk = vg.index_select(-2, c).unsqueeze(3)  # [B, Hkv, 1, 1, n, Dv]
        o = o + torch.where(kk, wk * vk, 0).sum(-2).reshape(B, Hq, rows, Dv)
    return o


# ------------------------------------------------------------------------------ serving batches
def _reference_cache(kv_cache: Any, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of the reference's `kv_cache` argument, each checked for its rank."""
    if isinstance(kv_cache, torch.Tensor) and kv_layout != "ragged" and kv_cache.dim() == 5 \
            and kv_cache.shape[1] == 2:
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k, v = kv_cache
    else:
        raise InvalidArgument("kv_cache must be (k_cache, v_cache) or a [num_pages, 2, ...] "
                              "tensor")
    rank = 3 if kv_layout == "ragged" else 4
    for name, t in (("k_cache", k), ("v_cache", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise InvalidArgument(f"{name} must be a {rank}-D tensor in the {kv_layout} layout, "
                                  f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else t}")
    return k, v


def _dequantized_cache(k: torch.Tensor, v: torch.Tensor, kv_layout: str, k_scale: Any,
                       v_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache's float64 values (runtime/kv8.py); a 16-bit cache as it is (no scales)."""
    fp8 = k.dtype in FP8_KV_DTYPES or v.dtype in FP8_KV_DTYPES
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise InvalidArgument(f"k_scale / v_scale are the scales of an fp8 cache; this "
                                  f"cache holds {k.dtype}: drop them")
        return k, v
    if k.dtype != v.dtype:
        raise InvalidArgument(f"k_cache is {k.dtype} and v_cache {v.dtype}: an fp8 cache holds "
                              f"one of {FP8_KV_DTYPES} in both")
    heads, axis = _cache_heads(k, kv_layout), 1 if kv_layout == "HND" else k.dim() - 2
    ks = kv_scale(1.0 if k_scale is None else k_scale, heads, "k_scale")
    vs = kv_scale(1.0 if v_scale is None else v_scale, heads, "v_scale")
    return dequantize(k, ks, head_axis=axis), dequantize(v, vs, head_axis=axis)


def _cache_heads(k: torch.Tensor, kv_layout: str) -> int:
    """KV heads of a cache: [pages, page, H, D] (NHD), [pages, H, page, D] (HND), [tokens, H, D]."""
    return int(k.shape[1] if kv_layout == "HND" else k.shape[-2])


def _check_reference_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: CheckedBatch,
                            kv_layout: str) -> None:
    """What `run` checks of q and the cache against the plan: every row, page id and token the
    batch names exists, and the cache's page size is the plan's."""
    total_q = int(b.qo[-1])
    if q.shape[0] < total_q:
        raise InvalidArgument(f"q has {q.shape[0]} rows but qo_indptr[-1] = {total_q}")
    Hkv = _cache_heads(k, kv_layout)
    where = "" if kv_layout == "ragged" else f", page_size={b.page}"
    # v_cache's head dim is its own (the value head dim may differ from q's and k's)
    for name, t, D in (("k_cache", k, q.shape[2]), ("v_cache", v, v.shape[-1])):
        if kv_layout == "ragged":
            want = (b.max_page, Hkv, D)
        else:
            want = ((b.max_page, b.page, Hkv, D) if kv_layout == "NHD"
                    else (b.max_page, Hkv, b.page, D))
        if t.shape[0] < want[0] or tuple(t.shape[1:]) != want[1:]:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}; the batch needs "
                                  f"[>={want[0]}, {', '.join(map(str, want[1:]))}] "
                                  f"({kv_layout} layout{where}; every page id and token must "
                                  f"fit)")


def batch_attention_reference(q: torch.Tensor, kv_cache: Any, qo_indptr: Any, kv_indptr: Any,
                              kv_indices: Any = None, kv_last_page_len: Any = None, *,
                              kv_layout: str = "NHD", page_size: int = 1,
                              variant: Variant | None = None, scale: float | None = None,
                              sinks: torch.Tensor | None = None,
                              custom_mask: Any = None, packed_custom_mask: Any = None,
                              k_scale: Any = None, v_scale: Any = None,
                              q_positions: Any = None, kv_position_offset: Any = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact (float64) batch attention, request by request: the oracle of `BatchAttention.run`.
    The hooks see b = the request's index, q_idx counted so that the queries are the request's
    last tokens, as in the batch kernels. `sinks` [num_qo_heads]: per-head sink logits, as in
    `attention_reference` (the LSE includes them); out has v's head dim, which may differ from
    q's and k's. `custom_mask` / `packed_custom_mask`:
    FlashInfer's per-request masks (`BatchAttention.plan`'s), ANDed with the variant's mask; any
    pattern here, where the kernels take tree masks only (docs/serving.md, "Multi-token decode
    and tree masks"). An fp8 cache is dequantized first (`k_scale` / `v_scale`: a float or a
    tensor [num_kv_heads], default 1; runtime/kv8.py). `q_positions` / `kv_position_offset`:
    the positions the hooks see, as `BatchAttention.plan` takes them (CascadeAttention's passes).

    Example:
        >>> import torch
        >>> q = torch.randn(3, 4, 64)
        >>> k, v = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)    # NHD pages
        >>> out, lse = batch_attention_reference(q, (k, v), [0, 1, 3], [0, 1, 2], [1, 0],
        ...                                      [10, 16], page_size=16)
        >>> tuple(out.shape), out.dtype
        ((3, 4, 64), torch.float64)
    """
    variant = variant if variant is not None else Variant(name="batch_plain")
    ir, bindings = variant.trace()
    k_all, v_all = _reference_cache(kv_cache, kv_layout)
    fp8 = k_all.dtype in FP8_KV_DTYPES or v_all.dtype in FP8_KV_DTYPES
    k_all, v_all = _dequantized_cache(k_all, v_all, kv_layout, k_scale, v_scale)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise InvalidArgument(f"q must be a [total_q, num_qo_heads, head_dim] tensor, got "
                              f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q)}")
    q_in = q.to(torch.float64) if fp8 else q  # (exact) the dequantized cache is float64
    # plan()'s checks, with the sizes read off q and the cache
    b = check_batch(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_layout=kv_layout,
                    num_qo_heads=q.shape[1], num_kv_heads=_cache_heads(k_all, kv_layout),
                    head_dim=q.shape[2], page_size=page_size, head_dims=None,
                    q_positions=q_positions, kv_position_offset=kv_position_offset)
    _check_reference_shapes(q, k_all, v_all, b, kv_layout)
    qo, kvp = b.qo, np_int(kv_indptr, "kv_indptr")
    H = q.shape[1]
    if sinks is not None:
        check_sinks(sinks, H, q.device, q.dtype)
        sinks = sinks.float()  # (exact; q's 16-bit dtype is not q_in's with an fp8 cache)
    out = torch.zeros(*q.shape[:2], v_all.shape[-1], dtype=torch.float64, device=q.device)
    lse = (torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
           if ir.use_softmax else None)
    pages = b.pages if kv_layout != "ragged" else None
    last = np_int(kv_last_page_len, "kv_last_page_len") if kv_last_page_len is not None else None
    masks = _request_masks(custom_mask, packed_custom_mask, b.qo, b.kv_lens)
    for i in range(qo.size - 1):
        lq = int(qo[i + 1] - qo[i])
        if lq == 0:
            continue
        if kv_layout == "ragged":
            k = k_all[int(kvp[i]):int(kvp[i + 1])]
            v = v_all[int(kvp[i]):int(kvp[i + 1])]
        else:
            assert pages is not None and last is not None
            ids = torch.as_tensor(pages[int(kvp[i]):int(kvp[i + 1])], device=k_all.device)
            if kv_layout == "NHD":
                k, v = k_all[ids].flatten(0, 1), v_all[ids].flatten(0, 1)
            else:
                k = k_all[ids].transpose(1, 2).flatten(0, 1)
                v = v_all[ids].transpose(1, 2).flatten(0, 1)
            n = (ids.numel() - 1) * page_size + int(last[i]) if ids.numel() else 0
            k, v = k[:n], v[:n]
        o_i, l_i = _request_attention(q_in[int(qo[i]):int(qo[i + 1])], k, v, ir, bindings, i, b,
                                      masks[i] if masks is not None else None, scale=scale,
                                      sinks=sinks)
        out[int(qo[i]):int(qo[i + 1])] = o_i[0].transpose(0, 1)
        if lse is not None and l_i is not None:
            lse[int(qo[i]):int(qo[i + 1])] = l_i[0].transpose(0, 1)
    return out, lse


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[tokens, H, D] as attention_reference's [1, H, tokens, D]."""
    return t.transpose(0, 1)[None]


def _request_attention(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: VariantIR,
                       bindings: Bindings, i: int, b: CheckedBatch, keep: torch.Tensor | None,
                       **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Request i's (out [1, H, lq, D], lse) over its keys `k`, `v` [n, Hkv, D]. By default
    its queries are the last lq positions of its sequence (q_idx = n - lq + t, kv_idx = j);
    with the batch's `q_positions` / `kv_position_offset` each query row runs alone at its
    position, over the keys behind `off` masked padding keys (kv_idx = off + j)."""
    lq, n = qi.shape[0], k.shape[0]
    kw.update(enable_gqa=qi.shape[1] != k.shape[1], b_offset=i)  # the hooks' b: the request
    if b.qpos is None and b.kvoff is None:
        return attention_reference(_heads_first(qi), _heads_first(k), _heads_first(v), ir,
                                   bindings, q_offset=n - lq, keep_mask=keep, **kw)
    pos = b.qpos[int(b.qo[i]):int(b.qo[i + 1])] if b.qpos is not None else range(n - lq, n)
    off = int(b.kvoff[i]) if b.kvoff is not None else 0
    kp, vp = (_heads_first(torch.cat([t.new_zeros((off, *t.shape[1:])), t])) for t in (k, v))
    rows = []
    for t, p in enumerate(pos):
        row_keep = torch.ones(1, off + n, dtype=torch.bool, device=k.device)
        row_keep[:, :off] = False
        if keep is not None:
            row_keep[:, off:] &= keep[t].to(k.device)
        rows.append(attention_reference(_heads_first(qi[t:t + 1]), kp, vp, ir, bindings,
                                        q_offset=int(p), keep_mask=row_keep, **kw))
    lses = [r[1] for r in rows]
    return (torch.cat([r[0] for r in rows], dim=2),
            torch.cat(lses, dim=2) if lses[0] is not None else None)


def _request_masks(custom_mask: Any, packed_custom_mask: Any, qo: Any, kv_lens: Any
                   ) -> list[torch.Tensor] | None:
    """Each request's bool [q_len, kv_len] mask from FlashInfer's flattened `custom_mask` or
    its per-request little-endian `packed_custom_mask` (None: neither given)."""
    if custom_mask is None and packed_custom_mask is None:
        return None
    if custom_mask is not None and packed_custom_mask is not None:
        raise InvalidArgument("pass custom_mask or packed_custom_mask, not both")
    packed = packed_custom_mask is not None
    flat = torch.as_tensor(packed_custom_mask if packed else custom_mask).detach().cpu()
    if flat.dtype != (torch.uint8 if packed else torch.bool) or flat.dim() != 1:
        raise InvalidArgument(f"{'packed_custom_mask' if packed else 'custom_mask'} must be a "
                              f"1-D {'uint8' if packed else 'bool'} tensor, got "
                              f"{tuple(flat.shape)} {flat.dtype}")
    out, at = [], 0
    for i in range(len(qo) - 1):
        lq, lkv = int(qo[i + 1] - qo[i]), int(kv_lens[i])
        n = lq * lkv
        seg = (n + 7) // 8 if packed else n
        if at + seg > flat.numel():
            raise InvalidArgument(f"the mask ends inside request {i}'s [{lq}, {lkv}] segment")
        part = flat[at:at + seg].numpy()
        if packed:
            part = np.unpackbits(part, bitorder="little")[:n].astype(bool)
        out.append(torch.as_tensor(np.asarray(part, bool)).reshape(lq, lkv))
        at += seg
    if at != flat.numel():
        raise InvalidArgument(f"the mask has {flat.numel()} elements; the batch's masks use {at}")
    return out
