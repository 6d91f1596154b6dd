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

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from attncc.errors import InvalidArgument, check_bool, check_int
from attncc.frontend import noop_mask, trace_mods
from attncc.ir.evaluator import evaluate
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
    num_blocks, indices = _collapse(num_blocks, indices)
    q_num, q_idx = _ordered(_bitmap(num_blocks, indices, indices.shape[-1]).transpose(-2, -1))
    return _broadcast(q_num, lead), _broadcast(q_idx, lead)


def _collapse(num: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`num [..., rows]` and `idx [..., rows, cols]` with each leading dim that both broadcast
    (stride 0, as create_block_mask makes them) cut to size 1: computed once, expanded back."""
    take = tuple(slice(0, 1) if idx.stride(d) == 0 and num.stride(d) == 0 else slice(None)
                 for d in range(idx.dim() - 2))
    return num[take], idx[take]


def _broadcast(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    return t.expand(*lead, *t.shape[len(lead):])


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
                       seq_lengths: tuple[int, int] | None = None,
                       compute_q_blocks: bool = True) -> "BlockMask":
        """Build from the kv-side lists (like torch's), deriving the transposed q-side lists
        unless `compute_q_blocks=False`. `mask_mod` None means `noop_mask`.

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
        check_bool("compute_q_blocks", compute_q_blocks)
        q_num = q_idx = fq_num = fq_idx = None
        if compute_q_blocks:
            q_num, q_idx = kv_major_blocks(kv_num_blocks, kv_indices)
        if compute_q_blocks and full_kv_num_blocks is not None:
            fq_num, fq_idx = kv_major_blocks(full_kv_num_blocks, full_kv_indices)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * bs[0], kv_indices.shape[-1] * bs[1])
        return cls(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num, q_idx,
                   fq_num, fq_idx, (int(bs[0]), int(bs[1])),
                   noop_mask if mask_mod is None else mask_mod,
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
        from torch.nn.attention import flex_attention as torch_flex

        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.contiguous()

        mask_mod = self.mask_mod
        if mask_mod is None or mask_mod is noop_mask:  # torch's noop traces under its vmap
            mask_mod = torch_flex.noop_mask
        if self.q_indices is None:
            return torch_flex.BlockMask.from_kv_blocks(
                c(self.kv_num_blocks), c(self.kv_indices), c(self.full_kv_num_blocks),
                c(self.full_kv_indices), BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod,
                seq_lengths=self.seq_lengths, compute_q_blocks=False)
        return torch_flex.BlockMask(
            seq_lengths=self.seq_lengths, kv_num_blocks=c(self.kv_num_blocks),
            kv_indices=c(self.kv_indices), full_kv_num_blocks=c(self.full_kv_num_blocks),
            full_kv_indices=c(self.full_kv_indices), q_num_blocks=c(self.q_num_blocks),
            q_indices=c(self.q_indices), full_q_num_blocks=c(self.full_q_num_blocks),
            full_q_indices=c(self.full_q_indices), BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod)

    def as_tuple(self, flatten: bool = True) -> tuple[Any, ...]:
        """The fields in the installed torch's `BlockMask.as_tuple` order, so torch's
        flex_attention (which passes `block_mask.as_tuple()` to its kernel) takes this mask.

        Example:
            >>> t = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256).as_tuple()
            >>> t[:2], t[2].tolist()
            ((256, 256), [[[1, 1]]])
        """
        return self.to_torch().as_tuple(flatten)

    def __getitem__(self, index: Any) -> "BlockMask":
        """The mask of some batches / heads / query blocks, as torch slices its BlockMask: an
        int keeps its dim (`bm[0]` has batch size 1), `seq_lengths` stay, and the mask_mod is
        replaced by one that refuses to run (it would see the wrong positions).

        Example:
            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 2, 4, 512, 512)
            >>> bm[0].kv_num_blocks.shape, bm[:, 1:3, :2].kv_indices.shape
            (torch.Size([1, 4, 4]), torch.Size([2, 2, 2, 4]))
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"a BlockMask takes at most 3 indices (batch, head, query block), "
                             f"got {len(index)}")
        index = index + (slice(None),) * (3 - len(index))
        dims = ("batch", "head", "query block")
        index = tuple(_keep_dim(i, n, d) for i, n, d in zip(index, self.kv_num_blocks.shape,
                                                             dims))

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return BlockMask.from_kv_blocks(
            take(self.kv_num_blocks), take(self.kv_indices),  # type: ignore[arg-type]
            take(self.full_kv_num_blocks), take(self.full_kv_indices),
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=_sliced_mask_mod(),
            seq_lengths=self.seq_lengths, compute_q_blocks=self.q_indices is not None)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """This mask cropped to its top-left `new_q_len x new_kv_len` corner (torch's `_adjust`:
        right for masks whose meaning does not depend on the lengths, such as causal).

        Unlike torch's, the counts are recomputed from the blocks kept (not assumed to be the
        first ones), and a FULL block that now sticks out past a new length becomes PARTIAL.

        Example:
            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 512, 512)
            >>> small = bm._adjust(256, 300)
            >>> small.shape, small.kv_num_blocks.tolist(), small.full_kv_num_blocks.tolist()
            ((1, 1, 256, 300), [[[1, 1]]], [[[0, 1]]])
        """
        bq, bkv = self.BLOCK_SIZE
        rows, cols = self.kv_indices.shape[-2:]
        new_q_len = check_int("new_q_len", new_q_len, 1, "pass the new number of queries")
        new_kv_len = check_int("new_kv_len", new_kv_len, 1, "pass the new number of keys")
        nq, nkv = -(-new_q_len // bq), -(-new_kv_len // bkv)
        if nq > rows or nkv > cols:
            raise InvalidArgument(
                f"_adjust({new_q_len}, {new_kv_len}) needs {nq} x {nkv} blocks but this mask has "
                f"{rows} x {cols} (shape {self.shape}); it only crops: create a new block mask "
                f"for the longer lengths")
        lead = tuple(self.kv_indices.shape[:-2])
        partial = _bitmap(*_collapse(self.kv_num_blocks, self.kv_indices), cols)[..., :nq, :nkv]
        full = None
        if self.full_kv_num_blocks is not None:
            full = _bitmap(*_collapse(self.full_kv_num_blocks, self.full_kv_indices),  # type: ignore[arg-type]
                           cols)[..., :nq, :nkv]
            partial, full = _demote_ragged_edges(partial, full, new_q_len % bq != 0,
                                                 new_kv_len % bkv != 0)
        lists = _lists_of(partial, full, lead, self.q_indices is not None)
        return BlockMask(*lists, self.BLOCK_SIZE, self.mask_mod, (new_q_len, new_kv_len),
                         self.mask_ir, self.bindings, self.classified_by)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A picture of the block mask per (batch, head), at most `grid_size` cells a side
        (-1: one cell per block): "██" every block in the cell FULL, "░░" some blocks computed
        (or partial), "  " none. At most `limit` (batch, head) pictures.

        Example:
            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 512, 512)
            >>> print(bm.to_string())
            (0, 0)
            ░░
            ██░░
            ████░░
            ██████░░
        """
        return _picture(self, grid_size, limit)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%,\n"
                f"{self.to_string()}\n)")

    def __repr__(self) -> str:
        partial = int(self.kv_num_blocks.sum())
        full = int(self.full_kv_num_blocks.sum()) if self.full_kv_num_blocks is not None else 0
        total = self.kv_indices.numel()
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        how = f", classified_by={self.classified_by}" if self.classified_by else ""
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%, blocks: {full} full + {partial} partial of "
                f"{total}, mask_mod={name}{how}, device={self.kv_indices.device})")


def _keep_dim(i: Any, n: int, dim: str) -> Any:
    """An int index as a length-1 slice (torch keeps every dim of a sliced BlockMask)."""
    if isinstance(i, bool) or not isinstance(i, int):
        return i
    if not -n <= i < n:
        raise IndexError(f"BlockMask {dim} index {i} is out of range for size {n}")
    i %= n
    return slice(i, i + 1)


def _sliced_mask_mod() -> Callable[..., Any]:
    """The mask_mod a sliced BlockMask carries: torch's own refusing stub (so torch's and
    attncc's flex_attention both say the mask was sliced), else one of ours."""
    from torch.nn.attention import flex_attention as torch_flex

    return getattr(torch_flex, "_sliced_mask_mod_error", _refuse_sliced)


def _refuse_sliced(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    raise InvalidArgument("this BlockMask was sliced (bm[...]), so its mask_mod would see the "
                          "wrong positions; create the block mask for the shape you use, or set "
                          ".mask_mod to a mask_mod written for the slice")


def _demote_ragged_edges(partial: torch.Tensor, full: torch.Tensor, rows: bool, cols: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Move FULL blocks of the last row (`rows`) / column (`cols`) to PARTIAL: they stick out
    past the sequence end, and torch's rule makes such blocks at most PARTIAL."""
    edge = torch.zeros(full.shape[-2:], dtype=torch.bool, device=full.device)
    if rows:
        edge[-1, :] = True
    if cols:
        edge[:, -1] = True
    return partial | (full & edge), full & ~edge


def _lists_of(partial: torch.Tensor, full: torch.Tensor | None, lead: tuple[int, ...],
              with_q: bool) -> list[torch.Tensor | None]:
    """The 8 block lists (kv, full kv, q, full q) of partial / full bitmaps, broadcast to lead."""
    maps = [(partial, False), (full, False)] + ([(partial, True), (full, True)] if with_q else [])
    out: list[torch.Tensor | None] = []
    for bitmap, kv_major in maps:
        if bitmap is None:
            out += [None, None]
            continue
        num, idx = _ordered(bitmap.transpose(-2, -1) if kv_major else bitmap)
        out += [_broadcast(num, lead), _broadcast(idx, lead)]
    return out + [None] * (8 - len(out))


def _picture(bm: BlockMask, grid_size: int | tuple[int, int], limit: int) -> str:
    """BlockMask.to_string: each cell covers step_r x step_c blocks."""
    state = _bitmap(bm.kv_num_blocks, bm.kv_indices, bm.kv_indices.shape[-1]).to(torch.int8)
    if bm.full_kv_num_blocks is not None:
        full = _bitmap(bm.full_kv_num_blocks, bm.full_kv_indices,  # type: ignore[arg-type]
                       bm.kv_indices.shape[-1])
        state = torch.where(full, 2, state).to(torch.int8)
    *lead, rows, cols = state.shape
    if grid_size == -1:
        grid = (rows, cols)
    else:
        grid = (grid_size, grid_size) if isinstance(grid_size, int) else tuple(grid_size)
    step_r, step_c = max(1, -(-rows // grid[0])), max(1, -(-cols // grid[1]))
    panels = []
    for n, at in enumerate(torch.cartesian_prod(*[torch.arange(d) for d in lead])
                           .reshape(-1, len(lead)).tolist()):
        if n == limit:
            panels.append("...\n(to_string(limit=N) prints more; bm[b, h] picks one)")
            break
        s = state[tuple(at)]
        lines = [str(tuple(at))]
        for r in range(0, rows, step_r):
            cells = [s[r:r + step_r, c:c + step_c] for c in range(0, cols, step_c)]
            lines.append("".join("██" if bool((x == 2).all()) else
                                 "░░" if bool((x > 0).any()) else "  " for x in cells).rstrip())
        panels.append("\n".join(lines))
    return "\n".join(panels)


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
                      BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_BLOCK, _compile: bool = False,
                      separate_full_blocks: bool = True) -> BlockMask:
    """Build the BlockMask of `mask_mod(b, h, q_idx, kv_idx) -> bool`, like torch's function.

    B / H None mean 1 (broadcast over batch / heads). `BLOCK_SIZE` is an int or (q, kv).
    `device` defaults to the device of the tensors the mask captures, else the CPU.
    `separate_full_blocks=False` lists every computed block as PARTIAL (no full lists), as
    torch's does. `_compile` is accepted for torch's signature and has nothing to do here: the
    mask is never evaluated element by element where it is analysable.

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
    check_bool("_compile", _compile)
    check_bool("separate_full_blocks", separate_full_blocks)
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
    full: torch.Tensor | None = kept == bq * bkv
    partial = (kept > 0) & ~full  # type: ignore[operator]
    if not separate_full_blocks:
        partial, full = kept > 0, None
    # the KV-major lists straight from the bitmaps: what kv_major_blocks(kv_num, kv_idx) gives;
    # a mask that reads neither b nor h is broadcast over B, H
    lists = _lists_of(partial, full, (B, H), True)
    return BlockMask(*lists, (bq, bkv), mask_mod, (int(Q_LEN), int(KV_LEN)),  # type: ignore[arg-type]
                     expr, Bindings(params, tensors), how)


def _mod_kind(fn: Any, caller: str) -> str:
    """"mask_mod" or "score_mod", by the number of parameters without a default (4 or 5)."""
    if not callable(fn):
        raise TypeError(f"{caller} needs a mask_mod(b, h, q_idx, kv_idx) or a "
                        f"score_mod(score, b, h, q_idx, kv_idx) function, got "
                        f"{type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): call it as a mask_mod
        return "mask_mod"
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return "mask_mod"
    n = sum(1 for p in params if p.default is p.empty and
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if n not in (4, 5):
        raise TypeError(f"{caller}: {getattr(fn, '__name__', fn)} takes {n} arguments; a "
                        f"mask_mod takes (b, h, q_idx, kv_idx) and a score_mod "
                        f"(score, b, h, q_idx, kv_idx)")
    return "mask_mod" if n == 4 else "score_mod"


def create_mask(mod_fn: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int,
                KV_LEN: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The dense bool mask [B, H, Q_LEN, KV_LEN] of a mask_mod (True = kept) or of a score_mod
    (True where a zero score is not sent to -inf), like torch's `create_mask`.

    Evaluated from the traced IR, so the values are the ones attncc's attention uses. B / H
    None mean 1; `device` defaults to the captured tensors' device, else the CPU.

    Example:
        >>> create_mask(lambda b, h, q, kv: q >= kv, None, None, 3, 3)[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
        >>> create_mask(lambda s, b, h, q, kv: torch.where(kv > q, -float("inf"), s),
        ...             1, 1, 2, 2)[0, 0].tolist()
        [[True, False], [True, True]]
    """
    kind = _mod_kind(mod_fn, "create_mask")
    Q_LEN = check_int("Q_LEN", Q_LEN, 0, "pass the number of query positions")
    KV_LEN = check_int("KV_LEN", KV_LEN, 0, "pass the number of key/value positions")
    B = 1 if B is None else check_int("B", B, 1, "pass the batch size, or None for 1")
    H = 1 if H is None else check_int("H", H, 1, "pass the number of heads, or None for 1")
    ir, bindings = trace_mods({kind: mod_fn})
    if device is None:
        device = next((t.device for t in bindings.tensors.values()), torch.device("cpu"))
    device = torch.device(device)
    env: dict[str, Any] = {
        name: torch.arange(n, device=device).view([n if d == i else 1 for d in range(4)])
        for i, (name, n) in enumerate((("b", B), ("h", H), ("q_idx", Q_LEN), ("kv_idx", KV_LEN)))}
    tensors = {k: v.to(device) for k, v in bindings.tensors.items()}
    shape = (B, H, Q_LEN, KV_LEN)
    if kind == "mask_mod":
        out = evaluate(ir.expr("mask_mod"), env, tensors, bindings.scalars)
        return out.to(torch.bool).expand(shape).contiguous()
    env["score"] = torch.zeros((), dtype=torch.float32, device=device)
    out = evaluate(ir.expr("score_mod"), env, tensors, bindings.scalars).expand(shape)
    return ~torch.isneginf(out)
