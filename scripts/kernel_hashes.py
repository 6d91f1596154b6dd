"""SHA-256 of the cubin of every shipped kernel form for the AttentionGym variants.

A behaviour-preserving change to `kernels/` or codegen leaves this list unchanged: run it before
and after, and diff. Each form goes through the runtime's own kernel cache
(runtime/jit/kernels.py: a `KernelSpec` -> `generate` -> `compile_spec` with its fallback forms,
or `compile_form` for one form) with NVRTC, no GPU needed.
One line a form, sorted by what follows the hash:

    <sha256>  <kind> <variant> D=<d> <arch> <kernel name> <form details>

Kinds: `fa2` (FlexAttention-style prefill, with the runtime's spill fallback tiles), `fa2-batch`
(serving prefill tiles) and `fa2-decode` (serving decode tiles, T_q = 16), `fa3-single`,
`fa3-pair`, `fa3-split` (a split-tail launch: the tail is a runtime branch of the single
form's cubin, so its hash equals `fa3-single`'s), `fa3-lowpressure` / `fa3-pair-lowpressure`
(the low-pressure form forced, whether or not the runtime needs it for the variant),
`fa3-batch` and `fa3-batch-lowpressure`, `fa3-batch-pair` (the batch kernel's pair form of
64-row units: multi-token decode; variants with q/k/v transforms have none), `fa3-hoisted`
(the attention kernel left after the pre-pass takes a variant's q/k/v transforms), `prepass`,
`merge` (variant `-`, D=-).
Inputs are bfloat16 (the merge kernel: bfloat16 and float16). Block-mask launches, whose mask
is merged into the variant's IR at run time, are not listed.

    python -m scripts.kernel_hashes --out bench/results/kernel-hashes.txt
    python -m scripts.kernel_hashes --kinds fa3-single,fa3-pair --variants causal --dims 128

`--code` appends ` code=<sha256>` to each line: the hash of the cubin's executable sections
(`.text.*`, the SASS) alone. A rename of a struct with static members changes the mangled names
in the cubin's symbol table, and so its hash, but not the code; this shows which it was.

Compiles go through the runtime's disk cache; point `ATTNCC_CACHE_DIR` at a scratch folder to
reuse compiles between runs. The hash is always of the cubin bytes NVRTC returned.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]

FA2_KINDS = ("fa2", "fa2-batch", "fa2-decode")
FA3_KINDS = ("fa3-single", "fa3-pair", "fa3-split", "fa3-lowpressure", "fa3-pair-lowpressure",
             "fa3-batch", "fa3-batch-lowpressure", "fa3-batch-pair", "fa3-hoisted")
KINDS = FA2_KINDS + FA3_KINDS + ("prepass", "merge")
ARCH = "sm_90a"
PREFILL_S = 4096   # FlexAttention-style prefill shape: B=1, H=16, S x S
SPLIT_S = 16384    # long enough that a dense FA3 launch runs unpaired with a split tail

Job = tuple[str, str, int, str]  # kind, variant, head dim, arch


def _sha(cubin: bytes) -> str:
    return hashlib.sha256(cubin).hexdigest()


CODE = os.environ.get("ATTNCC_HASH_CODE") == "1"  # set by --code (inherited by the workers)


def code_sections(cubin: bytes) -> dict[str, bytes]:
    """The `.text.*` sections (the SASS of each function) of an ELF64 cubin, by name.

    Example:
        >>> code_sections(b"not an ELF")
        Traceback (most recent call last):
        ...
        ValueError: not an ELF64 cubin
    """
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = heads[shstrndx][4], heads[shstrndx][5]
    names = cubin[strtab_off:strtab_off + strtab_size]
    out = {}
    for name_at, _type, _flags, _addr, off, size in heads:
        name = names[name_at:names.index(b"\0", name_at)].decode()
        if name.startswith(".text."):
            out[name] = cubin[off:off + size]
    return out


def _code_sha(cubin: bytes) -> str:
    h = hashlib.sha256()
    for name, code in sorted(code_sections(cubin).items()):
        h.update(name.encode() + b"\0" + len(code).to_bytes(8, "little") + code)
    return h.hexdigest()


def _line(cubin: bytes, kind: str, variant: str, d: Any, arch: str, name: str,
          details: str = "") -> str:
    line = f"{_sha(cubin)}  {kind} {variant} D={d} {arch} {name}" + (f" {details}" if details
                                                                     else "")
    return line + (f" code={_code_sha(cubin)}" if CODE else "")


def _ir(variant: str, d: int) -> Any:
    from attncc.ir.simplify import simplify_variant
    from attncc.gym import GYM

    return simplify_variant(GYM[variant](1, 16, PREFILL_S, d).trace()[0])


def _fa2_prefill(variant: str, d: int, arch: str) -> list[str]:
    """The FA2 prefill kernel at the planned tiles and, where ptxas spills past the budget, the
    fallback tiles the kernel cache walks to (each compiled form listed)."""
    from attncc.runtime.flex.gpu_flex import kernel_spec
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.runtime.jit.kernels import compile_spec

    plan = choose_tiles(d, q_len=PREFILL_S, kv_len=PREFILL_S, group=1, heads=16, batch=1)
    trail: list[Any] = []
    compile_spec(kernel_spec(_ir(variant, d), d, "bfloat16", plan), arch, trail)
    return [_line(f.result.cubin, "fa2", variant, d, arch, f.gen.kernel_name,
                  f"m_frags={f.spec.tiles.m_frags} fallback={i} spill={f.spill_bytes}")
            for i, f in enumerate(trail)]


def _fa2_batch(kind: str, variant: str, d: int, arch: str) -> list[str]:
    from attncc.runtime.jit.kernels import KernelTiles, KernelSpec, compile_spec
    from attncc.runtime.serving.batch import choose_batch_tiles

    rows = 1 if kind == "fa2-decode" else PREFILL_S
    t = choose_batch_tiles(d, rows, 132)
    spec = KernelSpec("decode" if t.kv_warps > 1 else "fa2_batch", _ir(variant, d), d,
                      "bfloat16", KernelTiles(t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps))
    f = compile_spec(spec, arch)
    return [_line(f.result.cubin, kind, variant, d, arch, f.gen.kernel_name,
                  f"kv_warps={t.kv_warps} spill={f.spill_bytes}")]


def _fa3_plan(d: int, paired: bool) -> Any:
    from attncc.runtime.flex.tile_choice import choose_tiles

    plan = choose_tiles(d, q_len=PREFILL_S, kv_len=PREFILL_S, group=1, heads=16, batch=1,
                        kernel_options={"KERNEL": "fa3"})
    return replace(plan, paired=paired)


def _forced_low(spec: Any, kind: str, variant: str, d: int, arch: str) -> list[str]:
    from attncc.runtime.jit.kernels import compile_form

    f = compile_form(replace(spec, low_pressure=True), arch)
    return [_line(f.result.cubin, kind, variant, d, arch, f.gen.kernel_name,
                  f"spill={f.spill_bytes}")]


def _fa3_dense(kind: str, variant: str, d: int, arch: str, ir: Any = None) -> list[str]:
    from attncc.runtime.flex.gpu_flex import FA3_SPLIT_HEAD_DIMS, kernel_spec
    from attncc.runtime.jit.kernels import compile_spec

    paired = kind.startswith("fa3-pair")
    if paired and d not in FA3_SPLIT_HEAD_DIMS:
        return []
    ir = ir if ir is not None else _ir(variant, d)
    spec = kernel_spec(ir, d, "bfloat16", _fa3_plan(d, paired))
    if kind.endswith("lowpressure"):
        return _forced_low(spec, kind, variant, d, arch)
    f = compile_spec(spec, arch)
    details = (f"paired={int(f.spec.paired)} low_pressure={int(f.spec.low_pressure)} "
               f"spill={f.spill_bytes}")
    if kind == "fa3-split":
        details += f" S={SPLIT_S}"
    return [_line(f.result.cubin, kind, variant, d, arch, f.gen.kernel_name, details)]


def _fa3_batch(kind: str, variant: str, d: int, arch: str) -> list[str]:
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.serving.fa3_batch import (FA3_BATCH_HEAD_DIMS, fa3_batch_tiles,
                                                  pair_form_runs)

    if d not in FA3_BATCH_HEAD_DIMS:
        return []
    ir = _ir(variant, d)
    pair = kind == "fa3-batch-pair"
    if pair and not pair_form_runs(ir):
        return []
    spec = KernelSpec("fa3_batch", ir, d, "bfloat16", fa3_batch_tiles(d, 64 if pair else 128))
    if kind.endswith("lowpressure"):
        return _forced_low(spec, kind, variant, d, arch)
    f = compile_spec(spec, arch)
    return [_line(f.result.cubin, kind, variant, d, arch, f.gen.kernel_name,
                  f"low_pressure={int(f.spec.low_pressure)} spill={f.spill_bytes}")]


def _hoisted(variant: str, d: int) -> tuple[Any, Any] | None:
    """(pre-pass IR, attention IR) when the runtime hoists all of the variant's q/k/v
    transforms (kernel_options PREPASS 'qkv', the choice for prefill shapes); None without
    transforms."""
    from attncc.ir.hoist import split_transforms, transforms_in
    from attncc.runtime.flex.prepass import choose_prepass

    ir = _ir(variant, d)
    if not transforms_in(ir):
        return None
    hooks = choose_prepass(ir, option="qkv", q_len=PREFILL_S, num_q_heads=16, num_kv_heads=16,
                           rows_per_cta=128, head_fusion=1)
    return split_transforms(ir, hooks)


def _prepass(kind: str, variant: str, d: int, arch: str) -> list[str]:
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec

    split = _hoisted(variant, d)
    if split is None:
        return []
    pre, attn = split
    if kind == "fa3-hoisted":
        return [ln.replace(" fa3-single ", " fa3-hoisted ", 1)
                for ln in _fa3_dense("fa3-single", variant, d, arch, attn)]
    f = compile_spec(KernelSpec("prepass", pre, d, "bfloat16"), arch)
    return [_line(f.result.cubin, kind, variant, d, arch, f.gen.kernel_name)]


def _merge(dtype: str, arch: str) -> list[str]:
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec

    f = compile_spec(KernelSpec("merge", dtype=dtype), arch)
    return [_line(f.result.cubin, "merge", "-", "-", arch, f.gen.kernel_name, f"dtype={dtype}")]


def run_job(job: Job) -> list[str]:
    """The hash lines of one (kind, variant, head dim, arch); [] where the form does not exist."""
    kind, variant, d, arch = job
    if kind == "merge":
        return _merge(variant, arch)
    if kind == "fa2":
        return _fa2_prefill(variant, d, arch)
    if kind in ("fa2-batch", "fa2-decode"):
        return _fa2_batch(kind, variant, d, arch)
    if kind.startswith("fa3-batch"):
        return _fa3_batch(kind, variant, d, arch)
    if kind in ("prepass", "fa3-hoisted"):
        return _prepass(kind, variant, d, arch)
    return _fa3_dense(kind, variant, d, arch)


def jobs(kinds: list[str], variants: list[str], dims: list[int], fa2_archs: list[str]
         ) -> Iterator[Job]:
    for kind in kinds:
        if kind == "merge":
            yield from (("merge", dt, 0, ARCH) for dt in ("bfloat16", "float16"))
            continue
        archs = fa2_archs if kind in FA2_KINDS else [ARCH]
        yield from ((kind, v, d, a) for v in variants for d in dims for a in archs)


def _csv(text: str | None, allowed: Any, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; choose from {', '.join(map(str, allowed))}")
    return items


def _check_checkout() -> None:
    """The list must be of this checkout's kernels: `python scripts/kernel_hashes.py` run from
    another folder imports the pip-installed attncc, which may be another checkout's."""
    import attncc

    where = Path(attncc.__file__).resolve().parents[1]
    if where != ROOT:
        raise SystemExit(f"attncc is imported from {where}, not from this checkout {ROOT}: run "
                         f"`python -m scripts.kernel_hashes` from {ROOT}")


def main(argv: list[str] | None = None) -> None:
    _check_checkout()
    from attncc.codegen.tiles import FA2_HEAD_DIMS
    from attncc.gym import GYM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", help=f"comma-separated, from {','.join(KINDS)} (default: all)")
    ap.add_argument("--variants", help="comma-separated AttentionGym names (default: all)")
    ap.add_argument("--dims", help="comma-separated head dims (default: 64,128,256)")
    ap.add_argument("--fa2-sm80", action="store_true", help="also the FA2 forms at sm_80")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--header", action="append", default=[],
                    help="a '# ' line to write above the list (repeatable)")
    ap.add_argument("--out", help="write the list here (else stdout)")
    ap.add_argument("--code", action="store_true",
                    help="append code=<sha256 of the cubin's .text sections> to each line")
    args = ap.parse_args(argv)
    if args.code:
        global CODE
        CODE = True
        os.environ["ATTNCC_HASH_CODE"] = "1"  # the ProcessPoolExecutor workers read it
    kinds = _csv(args.kinds, KINDS, "kinds") or list(KINDS)
    variants = _csv(args.variants, GYM, "variants") or list(GYM)
    dims = [int(x) for x in (_csv(args.dims, [str(d) for d in FA2_HEAD_DIMS], "dims")
                             or FA2_HEAD_DIMS)]
    todo = list(jobs(kinds, variants, dims, [ARCH] + (["sm_80"] if args.fa2_sm80 else [])))
    if args.jobs <= 1:
        results = [run_job(j) for j in todo]
    else:
        with ProcessPoolExecutor(args.jobs) as ex:
            results = list(ex.map(run_job, todo))
    lines = sorted((ln for r in results for ln in r), key=lambda ln: ln.split("  ", 1)[::-1])
    text = "".join(f"# {h}\n" for h in args.header) + "".join(ln + "\n" for ln in lines)
    if args.out:
        Path(args.out).write_text(text)
        print(f"{len(lines)} forms -> {args.out}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
