"""`create_block_mask` / `BlockMask`: FlexAttention's block-sparse mask, built without a dense mask.

The layout is exactly torch's (torch.nn.attention.flex_attention): for each (b, h, q-block) row,
`kv_num_blocks` counts the PARTIAL kv blocks (some but not all of their BLOCK_Q x BLOCK_KV
elements kept) and `kv_indices` lists them first in ascending order, followed by every other
block id in ascending order; `full_kv_*` do the same for FULL blocks (every element kept, so a
kernel may skip mask_mod there). Like torch, a block sticking out past Q_LEN / KV_LEN is never
FULL: its out-of-range elements count as masked. `q_*` / `full_q_*` are the transposed lists
(per kv block, the q blocks), as torch builds them for the backward pass. All int32.

Unlike torch, the mask is not evaluated element by element: the mask_mod is traced to IR, and
when it is a boolean combination of kv-monotone comparisons (causal, sliding window, prefix-LM,
chunked, document ranges, sorted document ids) every tile is classified analytically
(attncc.ir.tiles); other masks are evaluated densely one bounded chunk of query rows at a time.

When the mask does not read `b` (or `h`), the tensors are broadcast views (stride 0) of one
batch (head) over B (H): same shapes and values as torch's, without B * H copies.

Example:
    >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
    >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
    ([[[1, 1]]], [[[0, 1]]])
    >>> bm.kv_indices[0, 0].tolist(), bm.full_kv_indices[0, 0].tolist()
    ([[0, 1], [1, 0]], [[0, 1], [0, 1]])
    >>> bm.shape, round(bm.sparsity(), 2)
    ((1, 1, 256, 256), 25.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from attncc.errors import InvalidArgument, check_int
from attncc.frontend import trace_mods
from attncc.ir.nodes import F32, Node, walk
from attncc.ir.program import Bindings
from attncc.ir.tiles import block_classes, is_affine_mask

_DEFAULT_BLOCK = 128


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num, indices) of a block bitmap [..., rows, cols]: kept ids ascending, then the rest
    ascending (a stable descending sort, exactly torch's `_dense_to_ordered`)."""
    d = dense.to(torch.int32)
    num = d.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _bitmap(num: torch.Tensor, indices: torch.Tensor, cols: int) -> torch.Tensor:
    """The block bitmap [..., rows, cols] (bool) that (num, indices) describe."""
    slot = torch.arange(indices.shape[-1], device=indices.device)
    used = slot < num[..., None].to(torch.int64)
    col = torch.where(used, indices.to(torch.int64), cols)  # unused slots hit a spare column
    out = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, col, True)
    return out[..., :cols]


def kv_major_blocks(num_blocks: torch.Tensor, indices: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV-major (transposed) lists of Q-major block lists, as torch's BlockMask holds them.

    `num_blocks [..., q_blocks]` / `indices [..., q_blocks, kv_blocks]` (a row's first
    `num_blocks` entries are its kv blocks; the rest is padding and ignored) ->
    `(q_num_blocks [..., kv_blocks], q_indices [..., kv_blocks, q_blocks])`, int32 on the
    input's device: for each kv block the q blocks that list it, ascending, then every other q
    block ascending. Leading dims broadcast (stride 0, as create_block_mask makes them) are
    computed once and stay broadcast. The backward pass walks these lists
    (docs/flex-api.md, "Block lists").

    Example:
        >>> num = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
        >>> idx = torch.tensor([[[[0, 1], [1, 0], [1, 0]]]], dtype=torch.int32)
        >>> q_num, q_idx = kv_major_blocks(num, idx)
        >>> q_num.tolist(), q_idx.tolist()
        ([[[2, 2]]], [[[[0, 1, 2], [1, 2, 0]]]])
    """
    if indices.dim() < 2 or tuple(num_blocks.shape) != tuple(indices.shape[:-1]):
        raise InvalidArgument(f"kv_major_blocks needs num_blocks [..., q_blocks] and indices "
                              f"[..., q_blocks, kv_blocks], got {tuple(num_blocks.shape)} and "
                              f"{tuple(indices.shape)}")
    lead = tuple(indices.shape[:-2])
    # compute one copy along each broadcast (stride-0) leading dim, then expand back
    take = tuple(slice(0, 1) if indices.stride(d) == 0 and num_blocks.stride(d) == 0
                 else slice(None) for d in range(len(lead)))
    dense = _bitmap(num_blocks[take], indices[take], indices.shape[-1])
    q_num, q_idx = _ordered(dense.transpose(-2, -1))
    return (q_num.expand(*lead, *q_num.shape[len(lead):]),
            q_idx.expand(*lead, *q_idx.shape[len(lead):]))


@dataclass(eq=False)
class BlockMask:
    """Block-sparse attention mask in FlexAttention's layout (see the module docstring).

    Extra fields torch lacks: `mask_ir` / `bindings`, the traced mask and its captured values
    (so attention need not trace the mask again), and `classified_by`, "analytic" or "dense".

    Example:
        >>> bm = create_block_mask(lambda b, h, q, kv: q - kv < 100, 2, 4, 300, 300, BLOCK_SIZE=64)
        >>> bm.kv_indices.shape, bm.classified_by
        (torch.Size([2, 4, 5, 5]), 'analytic')
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    q_num_blocks: torch.Tensor | None
    q_indices: torch.Tensor | None
    full_q_num_blocks: torch.Tensor | None
    full_q_indices: torch.Tensor | None
    BLOCK_SIZE: tuple[int, int]
    mask_mod: Callable[..., Any] | None
    seq_lengths: tuple[int, int]
    mask_ir: Node | None = None
    bindings: Bindings | None = None
    classified_by: str = ""

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                       full_kv_num_blocks: torch.Tensor | None = None,
                       full_kv_indices: torch.Tensor | None = None,
                       BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_BLOCK,
                       mask_mod: Callable[..., Any] | None = None,
                       seq_lengths: tuple[int, int] | None = None) -> "BlockMask":
        """Build from the kv-side lists (like torch's), deriving the transposed q-side lists.

        Example:
            >>> num = torch.tensor([[[1, 2]]], dtype=torch.int32)
            >>> idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
            >>> bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64)
            >>> bm.q_num_blocks.tolist(), bm.q_indices.tolist(), bm.seq_lengths
            ([[[2, 1]]], [[[[0, 1], [1, 0]]]], (128, 128))
        """
        if kv_indices.dim() < 2:
            raise ValueError("kv_indices must be at least [q_blocks, kv_blocks]")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("pass both full_kv_num_blocks and full_kv_indices, or neither")
        bs = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
        q_num, q_idx = kv_major_blocks(kv_num_blocks, kv_indices)
        fq_num = fq_idx = None
        if full_kv_num_blocks is not None:
            fq_num, fq_idx = kv_major_blocks(full_kv_num_blocks, full_kv_indices)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * bs[0], kv_indices.shape[-1] * bs[1])
        return cls(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num, q_idx,
                   fq_num, fq_idx, (int(bs[0]), int(bs[1])), mask_mod,
                   (int(seq_lengths[0]), int(seq_lengths[1])))

    @property
    def shape(self) -> tuple[int, ...]:
        """(B, H, Q_LEN, KV_LEN), like torch's BlockMask.shape."""
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    def numel(self) -> int:
        """Elements of the (unblocked) mask: B * H * Q_LEN * KV_LEN."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def sparsity(self) -> float:
        """Percent of the mask's elements in blocks that are skipped (torch's definition).

        Example:
            >>> create_block_mask(lambda b, h, q, kv: q >= 0, 1, 1, 256, 256).sparsity()
            0.0
        """
        blocks = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            blocks += int(self.full_kv_num_blocks.sum())
        computed = blocks * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1]
        return 100.0 * (1.0 - computed / max(self.numel(), 1))

    def to_dense(self) -> torch.Tensor:
        """Block bitmap [B, H, q_blocks, kv_blocks] (int32, 1 = computed: partial or full).

        Example:
            >>> create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256).to_dense()[0, 0]
            tensor([[1, 0],
                    [1, 1]], dtype=torch.int32)
        """
        cols = self.kv_indices.shape[-1]
        dense = _bitmap(self.kv_num_blocks, self.kv_indices, cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | _bitmap(self.full_kv_num_blocks, self.full_kv_indices, cols)
        return dense.to(torch.int32)

    def to(self, device: torch.device | str) -> "BlockMask":
        """A copy with every tensor on `device` (captured mask tensors included).

        Example:
            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 128, 128)
            >>> bm.to("cpu").kv_indices.device
            device(type='cpu')
        """
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        bindings = self.bindings
        if bindings is not None:
            bindings = Bindings(dict(bindings.scalars),
                                {k: v.to(device) for k, v in bindings.tensors.items()})
        return BlockMask(mv(self.kv_num_blocks), mv(self.kv_indices),  # type: ignore[arg-type]
                         mv(self.full_kv_num_blocks), mv(self.full_kv_indices),
                         mv(self.q_num_blocks), mv(self.q_indices), mv(self.full_q_num_blocks),
                         mv(self.full_q_indices), self.BLOCK_SIZE, self.mask_mod,
                         self.seq_lengths, self.mask_ir, bindings, self.classified_by)

    def to_torch(self) -> Any:
        """The same mask as a torch.nn.attention.flex_attention.BlockMask (contiguous tensors).

        Example:
            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256)
            >>> type(bm.to_torch()).__name__, bm.to_torch().kv_num_blocks.tolist()
            ('BlockMask', [[[1, 1]]])
        """
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.contiguous()

        kwargs: dict[str, Any] = {"BLOCK_SIZE": self.BLOCK_SIZE, "seq_lengths": self.seq_lengths}
        if self.mask_mod is not None:
            kwargs["mask_mod"] = self.mask_mod
        return TorchBlockMask.from_kv_blocks(c(self.kv_num_blocks), c(self.kv_indices),
                                             c(self.full_kv_num_blocks), c(self.full_kv_indices),
                                             **kwargs)

    def __repr__(self) -> str:
        partial = int(self.kv_num_blocks.sum())
        full = int(self.full_kv_num_blocks.sum()) if self.full_kv_num_blocks is not None else 0
        total = self.kv_indices.numel()
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        how = f", classified_by={self.classified_by}" if self.classified_by else ""
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%, blocks: {full} full + {partial} partial of "
                f"{total}, mask_mod={name}{how}, device={self.kv_indices.device})")


def _has_float(expr: Node) -> bool:
    return any(n.dtype is F32 for n in walk(expr))


def _mask_for_analysis(expr: Node, params: dict[str, Any],
                       tensors: dict[str, torch.Tensor]) -> Node:
    """The traced mask as written, or its simplified form when only that one is analysable.

    The form as written is preferred: it is what torch (and partial tiles) evaluate. The
    simplifier is exact on integer arithmetic, so its output is used only for integer masks.
    """
    if is_affine_mask(expr, params, tensors):
        return expr
    try:
        from attncc.ir.simplify import simplify
    except ImportError:  # simplifier not available: analyse the mask as traced
        return expr
    if _has_float(expr):
        return expr
    simple = simplify(expr)
    return simple if is_affine_mask(simple, params, tensors) else expr


def _block_sizes(BLOCK_SIZE: Any) -> tuple[int, int]:
    """(query, kv) block sizes from an int or a pair of ints, each >= 1."""
    fix = "pass an int such as 128, or a (query, kv) pair of ints"
    if isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        return (check_int("BLOCK_SIZE[0]", BLOCK_SIZE[0], 1, fix),
                check_int("BLOCK_SIZE[1]", BLOCK_SIZE[1], 1, fix))
    if isinstance(BLOCK_SIZE, (tuple, list)):
        raise InvalidArgument(f"BLOCK_SIZE={BLOCK_SIZE!r} has {len(BLOCK_SIZE)} entries; {fix}")
    bs = check_int("BLOCK_SIZE", BLOCK_SIZE, 1, fix)
    return bs, bs


def create_block_mask(mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int,
                      KV_LEN: int, device: torch.device | str | None = None,
                      BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_BLOCK) -> BlockMask:
    """Build the BlockMask of `mask_mod(b, h, q_idx, kv_idx) -> bool`, like torch's function.

    B / H None mean 1 (broadcast over batch / heads). `BLOCK_SIZE` is an int or (q, kv).
    `device` defaults to the device of the tensors the mask captures, else the CPU.

    Example:
        >>> doc = torch.tensor([[0] * 100 + [1] * 200])
        >>> def same_doc(b, h, q, kv):
        ...     return doc[b, q] == doc[b, kv]
        >>> bm = create_block_mask(same_doc, 1, None, 300, 300, BLOCK_SIZE=100)
        >>> bm.full_kv_num_blocks.tolist(), bm.kv_num_blocks.tolist(), bm.classified_by
        ([[[1, 2, 2]]], [[[0, 0, 0]]], 'analytic')
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask needs a mask_mod function (b, h, q_idx, kv_idx) -> "
                        f"bool, got {type(mask_mod).__name__}")
    bq, bkv = _block_sizes(BLOCK_SIZE)
    Q_LEN = check_int("Q_LEN", Q_LEN, 1, "pass the number of query positions")
    KV_LEN = check_int("KV_LEN", KV_LEN, 1, "pass the number of key/value positions")
    B = 1 if B is None else check_int("B", B, 1, "pass the batch size, or None to broadcast")
    H = 1 if H is None else check_int("H", H, 1, "pass the number of heads, or None to "
                                                 "broadcast")
    ir, bindings = trace_mods({"mask_mod": mask_mod})
    params = dict(bindings.scalars)
    if device is None:
        devs = [t.device for t in bindings.tensors.values()]
        device = devs[0] if devs else torch.device("cpu")
    device = torch.device(device)
    tensors = {k: v.to(device) for k, v in bindings.tensors.items()}
    expr = _mask_for_analysis(ir.expr("mask_mod"), params, tensors)
    how = "analytic" if is_affine_mask(expr, params, tensors) else "dense"

    kept, _ = block_classes(expr, B, H, Q_LEN, KV_LEN, bq, bkv, params, tensors, device)
    # torch's rule: FULL means every one of the BLOCK_Q * BLOCK_KV elements is kept, so a block
    # reaching past the sequence end is at most PARTIAL
    full = kept == bq * bkv
    partial = (kept > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    fkv_num, fkv_idx = _ordered(full)
    # the KV-major lists straight from the bitmaps: what kv_major_blocks(kv_num, kv_idx) gives
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    fq_num, fq_idx = _ordered(full.transpose(-2, -1))

    def bh(t: torch.Tensor) -> torch.Tensor:  # broadcast a b/h-independent mask over B, H
        return t.expand(B, H, *t.shape[2:])

    return BlockMask(bh(kv_num), bh(kv_idx), bh(fkv_num), bh(fkv_idx), bh(q_num), bh(q_idx),
                     bh(fq_num), bh(fq_idx), (bq, bkv), mask_mod, (int(Q_LEN), int(KV_LEN)),
                     expr, Bindings(params, tensors), how)
