"""The numbers Python and the CUDA kernels both use, in one table.

The runtime plans launches with these values (threads per block, which head dims run
persistent, L2 section size, split-tail limits ...) and the kernels hard-code the same numbers
as `constexpr`s. Each row below names the C++ expression that holds the kernel's value;
`static_asserts(kernel)` turns the rows that kernel's translation unit declares into
`static_assert`s, which codegen emits into every unit (as `layout.py` does for the argument
structs), so changing one side alone fails compilation instead of launching a wrong grid.
docs/kernel-interface.md, section 5 lists them.

Example:
    >>> FA3_THREADS, FA3_PERSISTENT_HEAD_DIMS, FA3_SPLIT_HEAD_DIMS
    (384, (64, 128, 256), (64, 128))
    >>> static_asserts("merge")
    ['static_assert((attncc::merge::kThreads) == 256, "attncc.codegen.constants.MERGE_STATE_THREADS = 256 must equal attncc::merge::kThreads (kernels/small/merge_state.cuh): change both");']
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mirror", "MIRRORS", "static_asserts", "tile_static_asserts", "FA3_THREADS",
           "FA3_PERSISTENT_HEAD_DIMS", "FA3_SPLIT_HEAD_DIMS", "FA3_SLOT_WARPS", "MERGE_THREADS",
           "MERGE_STATE_THREADS", "L2_SECTION_BYTES", "MAX_PIECES_PER_ITEM", "MIN_SPLIT_KEYS",
           "PREPASS_WARPS", "EXACT_GRAD_WORDS", "BWD_ROWS_THREADS",
           "BWD_DQ_THREADS", "FA3_BWD_CONSUMER_REGS"]

_FA3 = ("fa3", "fa3batch")
_BATCH = ("fa2batch", "fa3batch")


@dataclass(frozen=True)
class Mirror:
    """One number both sides use: its Python name and value, the C++ expression holding the
    kernel's value (`{d}` stands for a head dim when the value is the set of head dims for
    which the expression is true), the header declaring it and the kernels whose unit has it."""

    name: str
    value: int | tuple[int, ...]
    cpp: str
    header: str
    kernels: tuple[str, ...]

    def asserts(self, head_dim: int) -> list[str]:
        """The C++ static_asserts pinning the kernel's value to `value` (a head-dim set: at
        `head_dim` only, an instantiation the unit already has; another would add a symbol)."""
        if isinstance(self.value, tuple):
            cpp, want = self.cpp.format(d=head_dim), str(head_dim in self.value).lower()
            return [f'static_assert(({cpp}) == {want}, "attncc.codegen.constants.{self.name} '
                    f'= {self.value} must agree with {cpp} (kernels/{self.header}): change '
                    f'both");']
        return [f'static_assert(({self.cpp}) == {self.value}, "attncc.codegen.constants.'
                f'{self.name} = {self.value} must equal {self.cpp} (kernels/{self.header}): '
                f'change both");']


MIRRORS: tuple[Mirror, ...] = (
    # a producer warpgroup and two consumer warpgroups
    Mirror("FA3_THREADS", 384, "attncc::fa3::kThreads", "fa3/fa3_consumer.cuh", _FA3),
    # the consumer warps, each with a split-tail slot and arrival counter per unit
    Mirror("FA3_SLOT_WARPS", 8, "attncc::fa3::kConsumers * 4", "fa3/fa3_consumer.cuh", _FA3),
    # head dims at which the dense FA3 kernel is persistent (else one CTA per 128-row item)
    Mirror("FA3_PERSISTENT_HEAD_DIMS", (64, 128, 256), "attncc::fa3::kPersistentHeadDim<{d}>",
           "fa3/fa3_prefill.cuh", ("fa3",)),
    # head dims at which it also has the split tail and the CTA-pair form (docs/fa3.md,
    # "The split K/V ring and D = 256")
    Mirror("FA3_SPLIT_HEAD_DIMS", (64, 128), "attncc::fa3::kSplitHeadDim<{d}>",
           "fa3/fa3_prefill.cuh", ("fa3",)),
    # K/V bytes of the heads whose items run together (docs/fa3.md, "Persistent scheduling")
    Mirror("L2_SECTION_BYTES", 12 << 20, "ATTNCC_FA3_L2_SECTION_BYTES_DEFAULT",
           "fa3/fa3_prefill.cuh", ("fa3",)),
    Mirror("MAX_PIECES_PER_ITEM", 4, "attncc::fa3::kMaxPiecesPerItem", "fa3/fa3_split.cuh",
           ("fa3",)),
    Mirror("MIN_SPLIT_KEYS", 4096, "attncc::fa3::kMinSplitKeys", "fa3/fa3_split.cuh", ("fa3",)),
    # the batch kernels' merge of split units (block size of NAME_merge)
    Mirror("MERGE_THREADS", 512, "attncc::fa2::MergeKernel::kThreads", "fa2/fa2_batch.cuh",
           _BATCH),
    # the attention-state merge kernel (runtime/serving/merge_kernel.py)
    Mirror("MERGE_STATE_THREADS", 256, "attncc::merge::kThreads", "small/merge_state.cuh",
           ("merge",)),
    Mirror("PREPASS_WARPS", 8, "attncc::prepass::kWarps", "small/prepass.cuh", ("prepass",)),
    # the FA3-class backward's row kernel (runtime/flex/backward.py)
    Mirror("BWD_ROWS_THREADS", 256, "attncc::bwdrows::kThreads", "small/bwd_rows.cuh",
           ("bwd_rows",)),
    # the FA3-class backward's dQ conversion (runtime/flex/backward.py fa3_dq)
    Mirror("BWD_DQ_THREADS", 256, "attncc::bwddq::kThreads", "small/bwd_dq.cuh", ("bwd_dq",)),
    # the FA3-class backward's consumer registers a thread (setmaxnreg; ptxas reports the
    # launch's 168, so scripts/backward_resources.py reports this one beside it)
    Mirror("FA3_BWD_CONSUMER_REGS", 240, "attncc::fa3bwd::kConsumerRegs", "fa3/fa3_backward.cuh",
           ("fa3bwd",)),
    # words per element of a captured gradient in the deterministic mode (12 of an exact sum,
    # 1 of non-finite flags; runtime/flex/exact_grad.py reads them back)
    Mirror("EXACT_GRAD_WORDS", 13, "attncc::kExactGradWords", "common/exact_grad.cuh",
           ("fa2bwd", "fa3bwd")),
)

_BY_NAME = {m.name: m for m in MIRRORS}
FA3_THREADS: int = _BY_NAME["FA3_THREADS"].value  # type: ignore[assignment]
FA3_SLOT_WARPS: int = _BY_NAME["FA3_SLOT_WARPS"].value  # type: ignore[assignment]
FA3_PERSISTENT_HEAD_DIMS: tuple[int, ...] = (
    _BY_NAME["FA3_PERSISTENT_HEAD_DIMS"].value)  # type: ignore[assignment]
FA3_SPLIT_HEAD_DIMS: tuple[int, ...] = (
    _BY_NAME["FA3_SPLIT_HEAD_DIMS"].value)  # type: ignore[assignment]
L2_SECTION_BYTES: int = _BY_NAME["L2_SECTION_BYTES"].value  # type: ignore[assignment]
MAX_PIECES_PER_ITEM: int = _BY_NAME["MAX_PIECES_PER_ITEM"].value  # type: ignore[assignment]
MIN_SPLIT_KEYS: int = _BY_NAME["MIN_SPLIT_KEYS"].value  # type: ignore[assignment]
MERGE_THREADS: int = _BY_NAME["MERGE_THREADS"].value  # type: ignore[assignment]
MERGE_STATE_THREADS: int = _BY_NAME["MERGE_STATE_THREADS"].value  # type: ignore[assignment]
PREPASS_WARPS: int = _BY_NAME["PREPASS_WARPS"].value  # type: ignore[assignment]
EXACT_GRAD_WORDS: int = _BY_NAME["EXACT_GRAD_WORDS"].value  # type: ignore[assignment]
BWD_ROWS_THREADS: int = _BY_NAME["BWD_ROWS_THREADS"].value  # type: ignore[assignment]
BWD_DQ_THREADS: int = _BY_NAME["BWD_DQ_THREADS"].value  # type: ignore[assignment]
FA3_BWD_CONSUMER_REGS: int = _BY_NAME["FA3_BWD_CONSUMER_REGS"].value  # type: ignore[assignment]


def static_asserts(kernel: str, head_dim: int = 0) -> list[str]:
    """The static_asserts of every row whose C++ side `kernel`'s unit (at `head_dim`) declares
    (a `generate.KERNELS` name, or "merge" for the attention-state merge kernel).

    Example:
        >>> [a.split(")")[0] for a in static_asserts("prepass", 64)]
        ['static_assert((attncc::prepass::kWarps']
        >>> static_asserts("fa3", 256)[2][:60]
        'static_assert((attncc::fa3::kPersistentHeadDim<256>) == true'
        >>> static_asserts("simple", 64)
        []
    """
    return [a for m in MIRRORS if kernel in m.kernels for a in m.asserts(head_dim)]


def tile_static_asserts(kernel: str, head_dim: int, threads: int, smem: int,
                        tiles: tuple[int, int, int, int, int]) -> list[str]:
    """The unit's launch geometry as Python computed it (`threads`, `smem` dynamic shared
    bytes; `tiles` = tq, tkv, stages, m_frags, kv_warps) against the template's own: FA2's
    Config, FA3's kThreads and Smem::kBytes.

    Example:
        >>> tile_static_asserts("fa3", 128, 384, 230584, (128, 128, 3, 1, 1))[1][:65]
        'static_assert(attncc::fa3::Smem<128, 128, 3>::kBytes == 230584, "'
    """
    tq, tkv, stages, m_frags, kv_warps = tiles
    if kernel in ("fa2bwd", "fa3bwd"):  # the fourth tile is BackwardTiles.dsplit
        ns = "fa2" if kernel == "fa2bwd" else "fa3bwd"
        cfg = f"attncc::{ns}::BwdConfig<{head_dim}, {tq}, {tkv}, {stages}, {m_frags}>"
        pairs = [(f"{cfg}::kThreads", threads), (f"{cfg}::kSmemBytes", smem)]
    elif kernel in _FA3:
        pairs = [("attncc::fa3::kThreads", threads),
                 (f"attncc::fa3::Smem<{head_dim}, {tkv}, {stages}>::kBytes", smem)]
    else:
        cfg = f"attncc::fa2::Config<{head_dim}, {tq}, {tkv}, {stages}, {m_frags}, {kv_warps}>"
        pairs = [(f"{cfg}::kThreads", threads), (f"{cfg}::kSmemBytes", smem)]
    return [f'static_assert({cpp} == {want}, "attncc.codegen (tiles.py / constants.py) '
            f'computed {want} for {cpp}: change both");' for cpp, want in pairs]
