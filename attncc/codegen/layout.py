"""C struct layouts mirrored in Python: AttentionParams, BatchParams and the generated
VariantParams_<name>.

The runtime packs kernel arguments as bytes from these descriptions, and every generated
translation unit static_asserts each offset and the size, so Python and C cannot silently
disagree. Layout follows the C rules of the x86-64 System V / CUDA ABI: each field at the next
multiple of its alignment, the struct size a multiple of the largest alignment.

Example:
    >>> lay = struct_layout("S", [("a", "int"), ("p", "const float*"), ("s", "attncc::i64", 2)])
    >>> [(f.name, f.offset, f.size) for f in lay.fields], lay.size, lay.align
    ([('a', 0, 4), ('p', 8, 8), ('s', 16, 16)], 32, 8)
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..ir.program import ScalarParam, TensorParam
from ..ir.nodes import F32, I32

# (size, alignment, struct-module format) of the scalar C types attncc puts in argument structs.
_SCALARS: dict[str, tuple[int, int, str]] = {
    "int": (4, 4, "i"),
    "float": (4, 4, "f"),
    "attncc::i64": (8, 8, "q"),
}
_POINTER = (8, 8, "Q")

# C storage type of each captured-tensor element dtype (VariantIR TensorParam.elem).
ELEM_CTYPES: dict[str, str] = {
    "float32": "float",
    "float64": "double",
    "float16": "attncc::f16",
    "bfloat16": "attncc::bf16",
    "int8": "signed char",
    "uint8": "unsigned char",
    "int16": "short",
    "int32": "int",
    "int64": "attncc::i64",
    "bool": "bool",
}


def _ctype_info(ctype: str) -> tuple[int, int, str]:
    if ctype.endswith("*"):
        return _POINTER
    if ctype not in _SCALARS:
        raise ValueError(f"no layout rule for C type {ctype!r}")
    return _SCALARS[ctype]


@dataclass(frozen=True)
class Field:
    """One struct member: `ctype name` (or `ctype name[count]` when `is_array`) at `offset`.

    `role` says what the runtime puts there: "ptr" / "stride" / "size" of captured tensor
    `ref`, "scalar" for captured scalar `ref`, "unused" for the filler of an empty struct, ""
    for AttentionParams members.
    """

    name: str
    ctype: str
    offset: int
    size: int
    align: int
    count: int = 1
    role: str = ""
    ref: str = ""
    is_array: bool = False

    @property
    def declaration(self) -> str:
        """The C declaration, e.g. `attncc::i64 bias_stride[2];`."""
        arr = f"[{self.count}]" if self.is_array else ""
        return f"{self.ctype} {self.name}{arr};"


@dataclass(frozen=True)
class StructLayout:
    """A C struct's members, size and alignment, as the compiler lays it out."""

    name: str  # the C type name, as used in sizeof(...)
    fields: tuple[Field, ...]
    size: int
    align: int

    def field(self, name: str) -> Field:
        """The member called `name`.

        Example:
            >>> ATTENTION_PARAMS.field("sm_scale").offset
            172
        """
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no member {name!r}; members: "
                       f"{', '.join(f.name for f in self.fields)}")

    def static_asserts(self) -> list[str]:
        """C++ static_asserts pinning the size, alignment and every member offset.

        Example:
            >>> struct_layout("S", [("a", "int")]).static_asserts()[0]
            'static_assert(sizeof(S) == 4, "Python layout: sizeof S");'
        """
        n = self.name
        out = [f'static_assert(sizeof({n}) == {self.size}, "Python layout: sizeof {n}");',
               f'static_assert(alignof({n}) == {self.align}, "Python layout: alignof {n}");']
        for f in self.fields:
            out.append(f'static_assert(ATTNCC_OFFSETOF({n}, {f.name}) == {f.offset}, '
                       f'"Python layout: {n}::{f.name}");')
        return out

    def pack(self, values: Mapping[str, Any]) -> bytes:
        """The struct's bytes (little endian) from member values; pointers are int addresses.

        Arrays take sequences; a pointer may be None (null). Missing members are an error, except
        the `_unused` filler, which is zero.

        Example:
            >>> lay = struct_layout("S", [("n", "int"), ("x", "float")])
            >>> lay.pack({"n": 3, "x": 0.5}).hex()
            '030000000000003f'
        """
        buf = bytearray(self.size)
        unknown = sorted(set(values) - {f.name for f in self.fields})
        if unknown:
            raise KeyError(f"{self.name} has no member(s) {', '.join(unknown)}")
        for f in self.fields:
            if f.name not in values:
                if f.role == "unused":
                    continue
                raise KeyError(f"no value given for {self.name}::{f.name}")
            v = values[f.name]
            items = list(v) if f.is_array else [v]
            if len(items) != f.count:
                raise ValueError(f"{self.name}::{f.name} holds {f.count} value(s), got "
                                 f"{len(items)}")
            fmt = _ctype_info(f.ctype)[2]
            items = [0 if x is None else x for x in items]
            if fmt in "iqQ":
                items = [int(x) for x in items]
            else:
                items = [float(x) for x in items]
            struct.pack_into("<" + fmt * f.count, buf, f.offset, *items)
        return bytes(buf)


def struct_layout(name: str, members: Iterable[Sequence[Any]]) -> StructLayout:
    """Lay out members `(name, ctype[, count[, role[, ref]]])` with the C rules.

    A member with a `count` (other than None) is an array, even of length 1.

    Example:
        >>> struct_layout("S", [("c", "int"), ("x", "attncc::i64")]).field("x").offset
        8
    """
    fields = []
    offset, align = 0, 1
    for m in members:
        fname, ctype = m[0], m[1]
        count = m[2] if len(m) > 2 else None
        role = m[3] if len(m) > 3 else ""
        ref = m[4] if len(m) > 4 else ""
        is_array = count is not None
        count = count if is_array else 1
        size, falign, _ = _ctype_info(ctype)
        offset = (offset + falign - 1) // falign * falign
        fields.append(Field(fname, ctype, offset, size * count, falign, count, role, ref,
                            is_array))
        offset += size * count
        align = max(align, falign)
    total = (offset + align - 1) // align * align
    return StructLayout(name, tuple(fields), max(total, 0), align)


# Mirrors kernels/common/attention_params.cuh member by member.
_ATTENTION_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"), ("o", "void*"),
    ("lse", "float*"),
    *((f"{t}_stride_{d}", "attncc::i64") for t in "qkvo" for d in "bhs"),
    ("lse_stride_b", "attncc::i64"), ("lse_stride_h", "attncc::i64"),
    ("batch", "int"), ("num_q_heads", "int"), ("num_kv_heads", "int"), ("q_len", "int"),
    ("kv_len", "int"), ("sm_scale", "float"),
    ("kv_num_blocks", "const int*"), ("kv_indices", "const int*"),
    ("full_kv_num_blocks", "const int*"), ("full_kv_indices", "const int*"),
    ("bm_stride_b", "attncc::i64"), ("bm_stride_h", "attncc::i64"),
    ("bi_stride_b", "attncc::i64"), ("bi_stride_h", "attncc::i64"), ("bi_stride_q", "attncc::i64"),
    ("block_q", "int"), ("block_kv", "int"), ("tma", "const void*"), ("item_counter", "int*"),
    ("split_partials", "float*"), ("sinks", "const float*"),
)

ATTENTION_PARAMS: StructLayout = struct_layout("attncc::AttentionParams", _ATTENTION_PARAMS_MEMBERS)

# Mirrors kernels/common/backward_params.cuh member by member (the backward kernels' argument).
_BACKWARD_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"), ("dout", "const void*"),
    ("lse", "const float*"), ("delta", "const float*"), ("dq_accum", "float*"),
    ("dk", "void*"), ("dv", "void*"),
    *((f"{t}_stride_{d}", "attncc::i64") for t in ("q", "k", "v", "do", "dq", "dk", "dv")
      for d in "bhs"),
    ("lse_stride_b", "attncc::i64"), ("lse_stride_h", "attncc::i64"),
    ("batch", "int"), ("num_q_heads", "int"), ("num_kv_heads", "int"), ("q_len", "int"),
    ("kv_len", "int"), ("sm_scale", "float"), ("sm_scale_log2", "float"),
    ("q_num_blocks", "const int*"), ("q_indices", "const int*"),
    ("full_q_num_blocks", "const int*"), ("full_q_indices", "const int*"),
    ("qm_stride_b", "attncc::i64"), ("qm_stride_h", "attncc::i64"),
    ("qi_stride_b", "attncc::i64"), ("qi_stride_h", "attncc::i64"), ("qi_stride_kv", "attncc::i64"),
    ("block_q", "int"), ("block_kv", "int"), ("kv_tile0", "int"), ("tma", "const void*"),
)

BACKWARD_PARAMS: StructLayout = struct_layout("attncc::BackwardParams", _BACKWARD_PARAMS_MEMBERS)

# Mirrors kernels/common/batch_params.cuh member by member (the persistent batch kernels' argument).
_BATCH_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"), ("o", "void*"),
    ("lse", "float*"), ("partial_o", "float*"), ("partial_lse", "float*"),
    *((n, "const int*") for n in ("qo_indptr", "kv_page_indptr", "kv_page_indices", "kv_lens",
                                   "plan", "q_positions", "kv_pos_offset")),
    ("tma", "const void*"), ("tree_mask", "const int*"),
    *((n, "attncc::i64") for n in ("q_stride_tok", "q_stride_h", "o_stride_tok", "o_stride_h",
                                   "kv_stride_page", "kv_stride_slot", "kv_stride_h")),
    ("lse_stride_tok", "int"), ("num_q_heads", "int"), ("num_kv_heads", "int"),
    ("page_size", "int"), ("page_shift", "int"), ("sm_scale", "float"),
    ("sinks", "const float*"),
    ("k_scale", "const float*"), ("v_scale", "const float*"),
)

BATCH_PARAMS: StructLayout = struct_layout("attncc::BatchParams", _BATCH_PARAMS_MEMBERS)

# The packed plan's int32 header as the batch kernels read it (kernels/common/batch_params.cuh; the
# scheduler's side is attncc.runtime.serving.plan.format, which takes these from here).
PLAN_DYNAMIC_SECTIONS = ("units", "cta_units", "merge_indptr", "merge_out")
"""The plan sections whose sizes vary from plan to plan, in memory order: ``units`` (``8 n``
words, WORK_UNIT_DTYPE rows), ``cta_units`` (``n``), ``merge_indptr`` (``m + 1``),
``merge_out`` (``5 m``, MERGE_TARGET_DTYPE rows); ``n`` units, ``m`` merges."""

PLAN_HEADER_FIELDS = (
    "magic", "version", "batch_size", "num_units", "num_ctas", "num_merges",
    "num_partial_slots", "kv_chunk", "tile_q", "group_size", "num_qo_heads", "num_kv_heads",
    "total_qo_tokens", "layout_size", *(f"{s}_at" for s in PLAN_DYNAMIC_SECTIONS),
    "reserved0", "reserved1", "reserved2", "reserved3", "reserved4", "reserved5",
)
"""The int32 header at offset 0 of a packed plan, in this order (a multiple of 4 words, so
``cta_indptr`` after it starts 16-byte aligned). ``<section>_at`` is the word offset of that
section (serving.plan.format.packed_offsets); ``layout_size`` is the PlanLayout's."""

PLAN_HEADER_CONSTANTS = (
    ("kPlanHeaderWords", len(PLAN_HEADER_FIELDS)),
    ("kPlanNumMerges", PLAN_HEADER_FIELDS.index("num_merges")),
    *((f"kPlan{s.title().replace('_', '')}At", PLAN_HEADER_FIELDS.index(f"{s}_at"))
      for s in PLAN_DYNAMIC_SECTIONS),
)
"""The header's size and the word indices the kernels read, by their names in
kernels/common/batch_params.cuh (`plan_header_static_asserts` pins them in every batch kernel)."""


def plan_header_static_asserts() -> list[str]:
    """C++ static_asserts pinning kernels/common/batch_params.cuh's plan header constants to
    `PLAN_HEADER_CONSTANTS` (every batch translation unit carries them, as it carries
    BatchParams' layout).

    Example:
        >>> plan_header_static_asserts()[1]
        'static_assert(attncc::kPlanNumMerges == 5, "Python plan header: kPlanNumMerges");'
    """
    return [f'static_assert(attncc::{name} == {value}, "Python plan header: {name}");'
            for name, value in PLAN_HEADER_CONSTANTS]


# Mirrors kernels/small/prepass.cuh's PrepassParams (the q/k/v transform pre-pass's argument): the
# tensors read and the transformed copies written, [batch, heads, len, head_dim] each with
# element strides and a contiguous head dim, and each tensor's number of warp tasks.
_PREPASS_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("q", "const void*"), ("k", "const void*"), ("v", "const void*"),
    ("q_out", "void*"), ("k_out", "void*"), ("v_out", "void*"),
    *((f"{t}_stride_{d}", "attncc::i64") for t in ("q", "k", "v", "q_out", "k_out", "v_out")
      for d in "bhs"),
    *((n, "int") for n in ("batch", "num_q_heads", "num_kv_heads", "q_len", "kv_len", "warps_q",
                           "warps_k", "warps_v")),
)

PREPASS_PARAMS: StructLayout = struct_layout("attncc::PrepassParams", _PREPASS_PARAMS_MEMBERS)

# Mirrors kernels/small/merge_state.cuh's MergeStateParams (two attention states merged into one).
_MERGE_STATE_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("o_a", "const void*"), ("lse_a", "const float*"), ("o_b", "const void*"),
    ("lse_b", "const float*"), ("o_out", "void*"), ("lse_out", "float*"),
    ("rows", "attncc::i64"), ("head_dim", "int"), ("softmax", "int"),
)

MERGE_STATE_PARAMS: StructLayout = struct_layout("attncc::MergeStateParams",
                                                 _MERGE_STATE_PARAMS_MEMBERS)

# Mirrors kernels/small/bwd_rows.cuh's BwdRowsParams (the FA3-class backward's row kernel).
_BWD_ROWS_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("dout", "const void*"), ("out", "const void*"), ("lse", "const float*"),
    ("dlse", "const float*"), ("rows", "float*"),
    *((f"{t}_stride_{d}", "attncc::i64") for t in ("do", "o", "lse", "dlse") for d in "bhs"),
    ("batch", "int"), ("heads", "int"), ("q_len", "int"), ("tiles", "int"), ("head_dim", "int"),
)

BWD_ROWS_PARAMS: StructLayout = struct_layout("attncc::BwdRowsParams", _BWD_ROWS_PARAMS_MEMBERS)

# Mirrors kernels/small/bwd_dq.cuh's BwdDqParams (the FA3-class backward's dQ conversion).
_BWD_DQ_PARAMS_MEMBERS: tuple[tuple[str, str], ...] = (
    ("acc", "const float*"), ("dq", "void*"),
    *((f"dq_stride_{d}", "attncc::i64") for d in "bhs"),
    ("heads", "int"), ("q_len", "int"), ("tiles", "int"), ("groups", "int"), ("scale", "float"),
)

BWD_DQ_PARAMS: StructLayout = struct_layout("attncc::BwdDqParams", _BWD_DQ_PARAMS_MEMBERS)

# ----------------------------------------------------------------------------- C names

_CPP_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
char32_t class compl concept const consteval constexpr constinit const_cast continue co_await
co_return co_yield decltype default delete do double dynamic_cast else enum explicit export
extern false float for friend goto if inline int long mutable namespace new noexcept not not_eq
nullptr operator or or_eq private protected public register reinterpret_cast requires return
short signed sizeof static static_assert static_cast struct switch template this thread_local
throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while
xor xor_eq restrict
""".split())
# Macros a CUDA compilation may define (nvcc pre-includes the runtime and math headers).
_MACROS = frozenset("""
NULL EOF INFINITY NAN HUGE_VAL HUGE_VALF HUGE_VALL assert offsetof errno stdin stdout stderr
M_E M_LOG2E M_LOG10E M_LN2 M_LN10 M_PI M_PI_2 M_PI_4 M_1_PI M_2_PI M_2_SQRTPI M_SQRT2 M_SQRT1_2
""".split())


def c_identifier(name: str) -> str:
    """A safe C++ identifier for a Python name: same text when possible, else a close variant.

    ASCII letters, digits and `_` are kept, other characters become `uXXXX`; keywords, macros
    and reserved spellings (`__x`, `_X`) get a trailing `_`.

    Example:
        >>> c_identifier("slopes"), c_identifier("new"), c_identifier("__x"), c_identifier("α")
        ('slopes', 'new_', '_2_x', 'u03b1')
    """
    out = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else f"u{ord(c):04x}"
                  for c in name) or "unnamed"
    if out[0].isdigit():
        out = "p_" + out
    # `__` anywhere and a leading `_X` are reserved to the implementation in C++.
    out = re.sub("__+", lambda m: f"_{len(m.group())}_", out)
    if out[0] == "_" and len(out) > 1 and out[1].isupper():
        out = "p" + out
    if out in _CPP_KEYWORDS or out in _MACROS or out.startswith("CUDA"):
        out += "_"
    return out


def _unique(base: str, taken: set[str], suffixes: Sequence[str] = ("",)) -> str:
    name = base
    while any(name + s in taken for s in suffixes):
        name += "_"
    taken.update(name + s for s in suffixes)
    return name


@dataclass(frozen=True)
class ParamsLayout:
    """VariantParams_<name>: its layout, and the C member each captured value lives in."""

    layout: StructLayout
    tensor_fields: Mapping[str, str]  # IR tensor name -> C member base name
    scalar_fields: Mapping[str, str]  # IR scalar name -> C member name


def variant_params_layout(struct_name: str, scalars: Sequence[ScalarParam],
                          tensors: Sequence[TensorParam]) -> ParamsLayout:
    """Layout of the generated params struct (tensors first, then scalars, in IR order).

    Per tensor `t`: `const <elem>* t; i64 t_stride[ndim]; i64 t_size[ndim];` (0-d tensors have
    no stride/size arrays: C++ has no zero-length arrays). Per scalar: `int` or `float`.
    An empty struct gets `int _unused;` so it is never empty.

    Example:
        >>> from attncc.ir.nodes import F32
        >>> lay = variant_params_layout("P", [ScalarParam("cap", F32)],
        ...                             [TensorParam("bias", "float32", 2, F32)]).layout
        >>> [(f.name, f.offset) for f in lay.fields], lay.size
        ([('bias', 0), ('bias_stride', 8), ('bias_size', 24), ('cap', 40)], 48)
    """
    taken: set[str] = {"_unused"}
    members: list[tuple[str, str, int | None, str, str]] = []
    tensor_fields: dict[str, str] = {}
    scalar_fields: dict[str, str] = {}
    for t in tensors:
        if t.elem not in ELEM_CTYPES:
            raise ValueError(f"captured tensor {t.name!r} has dtype {t.elem}, which kernels cannot "
                             f"read; convert it to one of {', '.join(ELEM_CTYPES)}")
        base = _unique(c_identifier(t.name), taken, ("", "_stride", "_size"))
        tensor_fields[t.name] = base
        members.append((base, f"const {ELEM_CTYPES[t.elem]}*", None, "ptr", t.name))
        if t.ndim > 0:
            members.append((base + "_stride", "attncc::i64", t.ndim, "stride", t.name))
            members.append((base + "_size", "attncc::i64", t.ndim, "size", t.name))
    for s in scalars:
        if s.dtype not in (I32, F32):
            raise ValueError(f"captured scalar {s.name!r} has type {s.dtype.value}; only i32 and "
                             f"f32 scalars are passed to kernels")
        fname = _unique(c_identifier(s.name), taken)
        scalar_fields[s.name] = fname
        members.append((fname, "int" if s.dtype is I32 else "float", None, "scalar", s.name))
    if not members:
        members.append(("_unused", "int", None, "unused", ""))
    return ParamsLayout(struct_layout(struct_name, members), tensor_fields, scalar_fields)


def variant_grads_layout(struct_name: str, tensors: Sequence[TensorParam],
                         grad_tensors: Sequence[str], tensor_fields: Mapping[str, str],
                         exact: bool = False) -> ParamsLayout:
    """Layout of the generated `VariantGrads_<name>` struct, the backward kernels' third
    argument: per captured tensor that requires grad (IR order), `float* <t>_grad;
    i64 <t>_grad_stride[ndim];` -- an fp32 buffer of the tensor's shape the kernel atomically
    adds into (element strides; a 0-d tensor has no stride array) -- where `<t>` is the tensor's
    member name in the params struct (`tensor_fields`). None: `int _unused;`. `exact` (the
    deterministic mode): `attncc::u64* <t>_grad`, EXACT_GRAD_WORDS words per element
    (kernels/common/exact_grad.cuh), the strides still counting elements.
    docs/backward.md, section 2.

    Example:
        >>> from attncc.ir.nodes import F32
        >>> ts = [TensorParam("bias", "bfloat16", 2, F32), TensorParam("s", "float32", 0, F32)]
        >>> pl = variant_grads_layout("G", ts, ("bias", "s"), {"bias": "bias", "s": "s"})
        >>> [(f.name, f.offset, f.role) for f in pl.layout.fields], pl.layout.size
        ([('bias_grad', 0, 'grad_ptr'), ('bias_grad_stride', 8, 'grad_stride'), ('s_grad', 24, 'grad_ptr')], 32)
        >>> dict(pl.tensor_fields)
        {'bias': 'bias_grad', 's': 's_grad'}
    """
    want = set(grad_tensors)
    members: list[tuple[str, str, int | None, str, str]] = []
    fields: dict[str, str] = {}
    for t in tensors:
        if t.name not in want:
            continue
        base = tensor_fields[t.name] + "_grad"
        fields[t.name] = base
        members.append((base, "attncc::u64*" if exact else "float*", None, "grad_ptr", t.name))
        if t.ndim > 0:
            members.append((base + "_stride", "attncc::i64", t.ndim, "grad_stride", t.name))
    if not members:
        members.append(("_unused", "int", None, "unused", ""))
    return ParamsLayout(struct_layout(struct_name, members), fields, {})


def variant_grad_values(layout: StructLayout, grads: Mapping[str, tuple[int, Sequence[int]]]
                        ) -> dict[str, Any]:
    """Member values of VariantGrads_<name>, ready for `layout.pack`: `grads` maps each captured
    tensor that requires grad to (device address of its fp32 buffer, strides in elements).

    Example:
        >>> from attncc.ir.nodes import F32
        >>> lay = variant_grads_layout("G", [TensorParam("b", "float32", 1, F32)], ("b",),
        ...                            {"b": "b"}).layout
        >>> lay.pack(variant_grad_values(lay, {"b": (4096, [1])})).hex()
        '00100000000000000100000000000000'
    """
    out: dict[str, Any] = {}
    for f in layout.fields:
        if f.role in ("grad_ptr", "grad_stride"):
            if f.ref not in grads:
                raise KeyError(f"no gradient buffer for captured tensor {f.ref!r}")
            ptr, strides = grads[f.ref]
            out[f.name] = ptr if f.role == "grad_ptr" else list(strides)
    return out
