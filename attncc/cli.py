"""The `attncc` command line: compile, export and explain attention variants.

TARGET is a `.attn` text file, or `module:name` where `module` is an importable module or a path
to a `.py` file and `name` an `attncc.Variant`, a score_mod/mask_mod function or a `VariantIR`.

    attncc compile examples/softcap_window.attn --emit ir
    attncc compile mymods.py:softcap --arch sm_90a --head-dim 128 --emit ptx
    attncc compile examples/alibi.attn --arch sm_80 --emit cubin -o alibi.cubin
    attncc export examples/rope.attn -o rope.cu --head-dim 128 --dtype bfloat16
    attncc explain examples/softcap_window.attn

Errors in the user's variant (AttnSyntaxError, TraceError, CompileError, ...) print a clean message
to stderr and exit with status 2; no traceback.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "causal.attn")
    >>> _ = open(path, "w").write("mask_mod = q_idx >= kv_idx\\n")
    >>> main(["compile", path, "--emit", "ir"])
    variant causal (normalize=softmax)
    mask_mod -> bool:
      return q_idx >= kv_idx
    0
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import AttnccError, AttnSyntaxError
from .ir.program import Bindings, VariantIR

EMITS = ("ir", "cuda", "ptx", "cubin")
# Every template attncc.codegen.generate.KERNELS has (tests/runtime/test_bad_inputs.py checks
# the keys).
KERNEL_HELP = {
    "simple": "exact, any dtype and GPU",
    "fa2": "FlashAttention-2-style bf16/fp16, sm_80+",
    "fa3": "Hopper TMA + wgmma bf16/fp16, sm_90a only",
    "fa2batch": "the serving kernel over a BatchAttention plan, sm_80+",
    "fa3batch": "the serving kernel on Hopper, sm_90a only",
    "prepass": "query/key/value transforms once per row",
    "fa2bwd": "the FA2-class backward (dQ, dK, dV, captured grads), sm_80+; not exported",
    "fa3bwd": "the FA3-class backward (wgmma), sm_90a only, head dims 64/128; not exported",
}


class UsageError(AttnccError):
    """The command line names something that cannot be used (missing file, bad target, ...)."""


# ----------------------------------------------------------------------------- targets


def _import_module_file(path: str) -> Any:
    """Import a .py file by path, its folder first on sys.path (as `python path.py` would)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"no such Python file: {path}")
    stem = Path(path).stem
    mod_name = f"_attncc_target_{stem}" if stem.isidentifier() else "_attncc_target"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py path always has a loader
        raise UsageError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    sys.modules[mod_name] = module  # dataclasses and pickling look classes up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:  # pragma: no cover - the module removed it itself
            pass
    return module


def _import_module(spec: str) -> Any:
    if spec.endswith(".py") or os.sep in spec or (os.altsep and os.altsep in spec):
        return _import_module_file(spec)
    # the console script does not put the working directory on sys.path; `python -m` does
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.startswith(e.name):
            raise UsageError(f"cannot import module {spec!r} ({e}); give a module on the Python "
                             f"path or a path to a .py file, e.g. ./mods.py:softcap") from None
        raise


def _as_ir(obj: Any, what: str) -> tuple[VariantIR, Bindings]:
    from .frontend.variant import Variant, as_variant

    if isinstance(obj, VariantIR):
        return obj, Bindings()
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], VariantIR):
        return obj[0], obj[1]
    if isinstance(obj, Variant):
        return obj.trace()
    if callable(obj):
        return as_variant(obj).trace()
    raise UsageError(f"{what} is a {type(obj).__name__}; it must be an attncc.Variant, a "
                     f"score_mod/mask_mod function or a VariantIR")


def load_target(target: str) -> tuple[VariantIR, Bindings]:
    """The traced IR and captured values of a command-line TARGET.

    `FILE.attn` is parsed; `module:name` (module may be a path to a .py file; name may be dotted)
    is imported and traced.

    Example:
        >>> ir, _ = load_target("attncc.frontend.variant:noop_mask")
        >>> print(ir.expr("mask_mod"))
        <True : bool>
    """
    if target.endswith(".attn"):
        from .frontend.text import load_attn

        if not os.path.isfile(target):
            raise UsageError(f"no such file: {target}")
        return load_attn(target)
    module_spec, sep, attr = target.rpartition(":")
    if not sep or not module_spec or not attr:
        if target.endswith(".py"):
            raise UsageError(f"{target}: name the variant inside the file, e.g. {target}:softcap")
        raise UsageError(f"{target!r} is not a target: give FILE.attn or module:function "
                         f"(module may be a path to a .py file)")
    return _as_ir(load_object(target), target)


def load_object(target: str) -> Any:
    """The Python object a `module:name` TARGET names (module may be a path to a .py file)."""
    module_spec, sep, attr = target.rpartition(":")
    obj = _import_module(module_spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise UsageError(f"{module_spec} has no attribute {part!r}"
                             + (f"; it defines {', '.join(names[:20])}" if names else ""))
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- commands


def _dtype(args: argparse.Namespace) -> str:
    from .runtime.jit.compile import dtype_name

    return dtype_name(args.dtype)


def _arch(args: argparse.Namespace) -> str:
    from .errors import CompileError
    from .runtime.jit.nvrtc import normalize_arch

    try:
        return normalize_arch(args.arch)
    except CompileError:
        if args.arch is not None:
            raise UsageError(f"--arch {args.arch}: not a GPU architecture; use e.g. sm_80 "
                             f"(A100) or sm_90a (H100/H200)") from None
        raise UsageError("there is no CUDA GPU here to compile for: pass --arch, e.g. "
                         "--arch sm_90a (H100/H200) or --arch sm_80 (A100)") from None


def _write_or_print(text: str, out: str | None) -> None:
    if out is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(f"wrote {out}", file=sys.stderr)


def _check_vectors(ir: VariantIR, bindings: Bindings, head_dim: int) -> None:
    """Head-vector reads outside [0, --head-dim) are an error naming the hook's line."""
    from .ir.analysis import check_vector_indices

    check_vector_indices(ir, head_dim, bindings.scalars)


def cmd_compile(args: argparse.Namespace) -> int:
    """`attncc compile TARGET --emit ir|cuda|ptx|cubin [-o OUT]`."""
    if args.emit == "cubin" and not args.output:
        raise UsageError("--emit cubin writes a binary file: give -o OUT.cubin")
    ir, bindings = load_target(args.target)
    if args.emit == "ir":
        from .ir.simplify import simplify_variant

        _write_or_print(simplify_variant(ir).format(), args.output)
        return 0
    _check_vectors(ir, bindings, args.head_dim)
    if args.emit == "cuda":
        from .codegen.generate import generate_source
        from .ir.simplify import simplify_variant

        gen = generate_source(simplify_variant(ir), head_dim=args.head_dim, dtype=_dtype(args),
                              kernel=args.kernel)
        _write_or_print(gen.source, args.output)
        return 0
    from .runtime.jit.compile import compile as compile_kernel

    kernel = compile_kernel(ir, head_dim=args.head_dim, dtype=_dtype(args), arch=_arch(args),
                            kernel=args.kernel)
    if args.emit == "ptx":
        _write_or_print(kernel.ptx(), args.output)
        return 0
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_bytes(kernel.cubin)
    print(f"wrote {args.output} ({len(kernel.cubin)} bytes, {kernel.arch}, "
          f"kernel {kernel.kernel_name})", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`attncc export TARGET -o FILE.cu`: the standalone CUDA source (no NVRTC needed)."""
    from .codegen.export import export_source
    from .ir.simplify import simplify_variant

    ir, bindings = load_target(args.target)
    _check_vectors(ir, bindings, args.head_dim)
    text = export_source(simplify_variant(ir), head_dim=args.head_dim, dtype=_dtype(args),
                         kernel=args.kernel, filename=Path(args.output).name)
    _write_or_print(text, args.output)
    return 0


def _hook_bodies(ir: VariantIR) -> str:
    """The C++ each hook of a (simplified) variant becomes, one block per hook."""
    from .codegen.generate import generate_variant

    code = generate_variant(ir)
    blocks = []
    for hook in code.hooks:
        if not hook.enabled:
            continue
        lines = [f"// {c}" for c in hook.comments]
        lines.append(hook.signature + " {")
        lines += [f"  {b}" for b in hook.body]
        lines.append("}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "(every hook is the identity: no code)"


def cmd_explain(args: argparse.Namespace) -> int:
    """`attncc explain TARGET`: traced IR, simplified IR and the generated CUDA hook bodies."""
    from .ir.simplify import simplify_variant

    ir, _ = load_target(args.target)
    simple = simplify_variant(ir)
    sections = (("traced IR", ir.format()), ("simplified IR", simple.format()),
                ("CUDA hook bodies", _hook_bodies(simple)))
    out = []
    for title, body in sections:
        out.append(f"== {title} ==\n{body}\n")
    sys.stdout.write("\n".join(out))
    return 0


# ----------------------------------------------------------------------------- argument parsing


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def cmd_warm(args: argparse.Namespace) -> int:
    """`attncc warm TARGET... --shape B,H,S... --arch ARCH...`: compile what flex_attention
    will run for these variants and shapes into the cache directory (no GPU needed)."""
    from .errors import InvalidArgument
    from .frontend.variant import as_variant
    from .runtime.flex import warm

    try:
        shapes = [warm.parse_shape(s) for s in args.shape]
    except InvalidArgument as e:
        raise UsageError(f"--shape: {e}") from None
    targets = []
    for target in args.target:
        if args.block_mask:
            if target.endswith(".attn"):
                raise UsageError(f"{target}: --block-mask needs a Python variant (module:name), "
                                 f"whose mask_mod is a function")
            targets.append(warm.split_block_mask(as_variant(load_object(target))))
        else:
            targets.append((*load_target(target), None))
    archs = args.arch or [_arch(argparse.Namespace(arch=None))]
    lines = warm.warm(targets, shapes, head_dims=args.head_dim,
                      dtypes=[_dtype(argparse.Namespace(dtype=d)) for d in args.dtype],
                      archs=archs, num_sms=args.sms, max_workers=args.jobs)
    from .runtime.jit.cache import default_cache_dir

    print("\n".join(lines))
    print(f"{len(lines)} kernels in {default_cache_dir()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for `attncc` (subcommands compile, export, warm, explain).

    Example:
        >>> build_parser().parse_args(["compile", "x.attn", "--emit", "ir"]).head_dim
        128
    """
    from .version import __version__

    parser = argparse.ArgumentParser(
        prog="attncc", description="Compile attention variants (FlexAttention-style mods or "
                                   ".attn files) to CUDA.",
        epilog="TARGET: FILE.attn, or module:name / path/to/file.py:name naming an "
               "attncc.Variant or a score_mod/mask_mod function.")
    parser.add_argument("--version", action="version", version=f"attncc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def codegen_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("target", metavar="TARGET", help="FILE.attn or module:function")
        p.add_argument("--head-dim", type=_positive_int, default=128,
                       help="size of the last dim of q/k/v (default 128)")
        p.add_argument("--dtype", default="bfloat16",
                       help="q/k/v/o storage dtype: bfloat16 (default), float16 or float32")
        p.add_argument("--kernel", default="simple", choices=tuple(KERNEL_HELP),
                       help="kernel template to instantiate: " + "; ".join(
                           f"{k} ({v})" for k, v in KERNEL_HELP.items()) + "; default: simple")

    p = sub.add_parser("compile", help="compile a variant and print its IR, CUDA or PTX, or "
                                       "write its cubin",
                       description="Compile a variant. --emit ir prints the simplified IR; cuda "
                                   "the generated CUDA; ptx the PTX; cubin writes the cubin "
                                   "to -o.")
    codegen_options(p)
    p.add_argument("--arch", default=None,
                   help="GPU architecture, e.g. sm_80 or sm_90a (default: the current GPU)")
    p.add_argument("--emit", choices=EMITS, default="cubin", help="what to produce (default "
                                                                  "cubin, which needs -o)")
    p.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("export", help="write a standalone .cu for the variant",
                       description="Write the standalone CUDA source of a variant (nvcc -c "
                                   "compiles it).")
    codegen_options(p)
    p.add_argument("-o", "--output", required=True, help="the .cu file to write")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("warm", help="compile the kernels flex_attention will run for variants "
                                    "and shapes into the cache directory (no GPU needed)",
                       description="Precompile, for a deployment image or a cold machine, the "
                                   "kernels attncc.flex_attention plans for each TARGET at each "
                                   "--shape, head dim, dtype and --arch, into $ATTNCC_CACHE_DIR.")
    p.add_argument("target", metavar="TARGET", nargs="+", help="FILE.attn or module:name")
    p.add_argument("--shape", action="append", required=True, metavar="B,H,S[,HKV[,SKV]]",
                   help="q is [B, H, S, D], k/v [B, HKV, SKV, D]; repeat for more shapes")
    p.add_argument("--head-dim", type=_positive_int, nargs="+", default=[128])
    p.add_argument("--dtype", nargs="+", default=["bfloat16"])
    p.add_argument("--arch", nargs="+", default=None,
                   help="GPU architectures, e.g. sm_90a sm_80 (default: the current GPU)")
    p.add_argument("--sms", type=_positive_int, default=None,
                   help="the GPU's SM count (default: 132 for sm_90a, 108 for sm_80, ...)")
    p.add_argument("--block-mask", action="store_true",
                   help="pass each variant's mask_mod as a block mask (create_block_mask), as "
                        "FlexAttention code does")
    p.add_argument("--jobs", type=_positive_int, default=None,
                   help="parallel compile processes (default: the CPU count)")
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("explain", help="show traced IR, simplified IR and the CUDA hook bodies")
    p.add_argument("target", metavar="TARGET", help="FILE.attn or module:function")
    p.set_defaults(func=cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `attncc` command line; returns the exit status (0 ok, 2 error).

    Example:
        >>> main(["compile", "no_such_file.attn", "--emit", "ir"])
        2
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: argparse already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except AttnSyntaxError as e:  # already "file:line:col: error: ..." with the source line
        print(str(e), file=sys.stderr)
        return 2
    except AttnccError as e:
        print(f"attncc: error: {e}", file=sys.stderr)
        log = getattr(e, "log", "")
        if log and log.strip() and log.strip() not in str(e):
            print(f"NVRTC log:\n{log.rstrip()}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"attncc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover - interactive
        return 130


if __name__ == "__main__":
    sys.exit(main())
