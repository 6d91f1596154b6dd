"""Write docs/ops.md: which of torch's elementwise ops a mod can call, generated from torch.

The op list is torch's own: the elementwise sections of `torch._refs.__all__` (unary, binary,
ternary, conditional, data conversion, the `*_like` / `new_*` creators), `torch._refs.special`
and `torch._refs.nn.functional`, and the Python operators `torch.Tensor` implements. Each op is
one row: whether a mod can call it (`yes`; `error`: it raises a TraceError because the result
cannot be computed exactly; `no`), the spellings that exist in torch, and a note: how it traces
(`attncc.frontend.torch_ops.COVERAGE`) or why it is not supported. Every `yes` spelling is run
against torch by `tests/frontend/test_ops.py` and compiled by `tests/codegen/test_ops_compile.py`;
`tests/frontend/test_ops_table.py` checks the committed table is this script's output.

    python -m scripts.ops_table            # rewrite docs/ops.md
    python -m scripts.ops_table --check    # exit 1 when docs/ops.md is stale
"""
from __future__ import annotations

import argparse
import inspect
import operator
import re
import sys
from pathlib import Path

import torch
import torch._refs
import torch._refs.nn.functional
import torch._refs.special

from attncc.frontend.torch_ops import COVERAGE, UNSUPPORTED

DOC = Path(__file__).resolve().parent.parent / "docs" / "ops.md"

# sections of torch._refs.__all__ (its own comments) -> the table's headings
_SECTIONS = {"Elementwise Unary References": "Elementwise unary",
             "Elementwise Binary References": "Elementwise binary",
             "Elementwise Ternary References": "Elementwise ternary and conditional",
             "Conditional references": "Elementwise ternary and conditional",
             "Data conversion and movement references": "Data conversion",
             "Tensor Creation": "Values like a traced value"}
# why an elementwise op is not supported (the default: "not supported yet")
_WHY = {
    **{n: "random numbers" for n in ("exponential", "geometric", "log_normal", "normal",
                                     "cauchy", "randn", "alpha_dropout", "dropout")},
    **{n: "not elementwise: reduces over a dim or reads other elements"
       for n in ("count_nonzero", "norm", "softmax", "log_softmax", "logsumexp", "trace",
                 "index_add", "index_copy", "index_select", "index_fill", "softmin", "glu",
                 "channel_shuffle", "group_norm", "layer_norm", "pdist", "pairwise_distance",
                 "copy_to")},
    "item": "a Python number: a mod's values are traced, not concrete",
    **{n: "uninitialised values" for n in ("empty_like", "new_empty", "new_empty_strided")},
    "fill": "use torch.full_like",
    **{n: "in-place: a mod returns a new value" for n in (
        "fill_", "index_copy_", "index_fill_", "masked_fill_", "celu_", "elu_", "mish_",
        "selu_", "threshold_")},
    **{n: "a loss over a batch, not a per-element op" for n in (
        "hinge_embedding_loss", "huber_loss", "l1_loss", "margin_ranking_loss", "mse_loss",
        "nll_loss", "poisson_nll_loss", "smooth_l1_loss", "triplet_margin_loss")},
    "imag": "no complex values in a mod",
    **{n: "no CUDA libm function; needs its own algorithm" for n in (
        "digamma", "i0", "mvlgamma", "multigammaln", "igamma", "igammac", "zeta", "bessel_j0",
        "bessel_j1", "spherical_bessel_j0", "i0e", "i1", "i1e", "erfcx", "ndtri", "log_ndtr",
        "gcd", "lcm", "polygamma")},
    **{n: "torch fuses roundings (an FMA) that the IR does not spell" for n in (
        "lerp", "addcmul", "addcdiv")},
}
_NO = "not supported yet"


def _all_with_sections(module) -> list[tuple[str, str]]:
    """(section comment, name) in the order of the module's `__all__` source."""
    src = inspect.getsource(module)
    body = src[src.index("__all__ = ["):]
    body = body[:body.index("]")]
    section, out = "", []
    for line in body.splitlines():
        text = line.strip()
        m = re.fullmatch(r"#\s*([A-Z][\w ]+)", text)
        if m:
            section = m.group(1).strip()
            continue
        m = re.match(r'"(\w+)"', text)
        if m:
            out.append((section, m.group(1)))
    return out


def _operator_dunders() -> list[str]:
    """Python operators torch.Tensor implements (`__add__`, `__radd__`, `__lshift__`, ...):
    its dunders that name an `operator` function, reflected ones included, in-place ones not."""
    ops = {k for k, v in vars(operator).items() if k.startswith("__") and callable(v)}
    skip = {"__index__", "__contains__", "__getitem__", "__setitem__", "__delitem__",
            "__matmul__", "__concat__", "__call__"}
    names = []
    for name in sorted(dir(torch.Tensor)):
        plain = "__" + name[3:] if name.startswith("__r") else name
        if name in skip or plain in skip or "__" + name[3:] in ops:
            continue  # (x += y on a traced value falls back to __add__: a new value)
        if name in ops or (name.startswith("__r") and plain in ops):
            names.append(name)
    return names


def _spellings(name: str, owners: tuple[str, ...]) -> list[str]:
    objs = {"torch": torch, "Tensor": torch.Tensor, "torch.special": torch.special,
            "torch.nn.functional": torch.nn.functional}
    return [f"{o}.{name}" for o in owners if callable(getattr(objs[o], name, None))]


def _row(name: str, spellings: list[str]) -> tuple[str, str, str, str]:
    yes = [s for s in spellings if s in COVERAGE and s not in UNSUPPORTED]
    err = [s for s in spellings if s in UNSUPPORTED]
    status = "yes" if yes else "error" if err else "no"
    notes = [COVERAGE[s] for s in yes + err if COVERAGE[s]]
    if status == "yes" and err:
        notes.append(f"{', '.join(f'`{s}`' for s in err)}: {COVERAGE[err[0]][len('error: '):]}")
    note = notes[0] if notes else "" if status != "no" else _WHY.get(name, _NO)
    if status == "error":
        note = note[len("error: "):] if note.startswith("error: ") else note
    return name, status, ", ".join(f"`{s}`" for s in spellings), note


def rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """Heading -> rows (op, supported, spellings, notes)."""
    out: dict[str, list] = {}
    seen: set[str] = set()

    def add(heading: str, name: str, owners: tuple[str, ...]) -> None:
        spellings = [s for s in _spellings(name, owners) if s not in seen]
        if not spellings:
            return
        seen.update(spellings)
        out.setdefault(heading, []).append(_row(name, spellings))

    for section, name in _all_with_sections(torch._refs):
        heading = _SECTIONS.get(section)
        if heading == "Values like a traced value" and not (
                name.endswith("_like") or name.startswith("new_")):
            continue
        if heading is not None:
            add(heading, name, ("torch", "Tensor", "torch.special"))
    for name in ("float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte",
                 "bool", "type"):
        add("Data conversion", name, ("Tensor",))
    for name in torch._refs.special.__all__:
        add("torch.special", name, ("torch.special", "torch"))
    for name in torch._refs.nn.functional.__all__:
        add("torch.nn.functional (elementwise activations)", name, ("torch.nn.functional",))
    for name in _operator_dunders():
        add("Python operators", name, ("Tensor",))
    rest = sorted(set(COVERAGE) - seen)  # supported names torch's lists do not hold
    for qual in rest:
        owner, name = qual.rsplit(".", 1)
        add("Other names a mod can call", name, (owner,))
    return out


def render() -> str:
    n_yes = sum(r[1] == "yes" for rs in rows().values() for r in rs)
    lines = [
        "# Torch ops in a mod",
        "",
        "Which of torch's elementwise ops a `score_mod` / `mask_mod` / transform can call, and how "
        "each traces. Generated by `python -m scripts.ops_table` from torch "
        f"{'.'.join(torch.__version__.split('.')[:2])}'s op lists (`torch._refs`, "
        "`torch._refs.special`, `torch._refs.nn.functional` and the Python operators of "
        "`torch.Tensor`); do not edit by hand.",
        "",
        "A mod computes one float32, int32 or bool value per position, as FlexAttention's mods "
        "compute on float32 scores and int32 indices, and each supported op means what torch "
        "computes there (docs/semantics.md): integer and boolean results bit for bit, NaN and "
        "infinities as torch. `error` means the call raises a `TraceError` naming the line, "
        "because its result cannot be represented exactly (a float64 or float16 value, an int8 "
        "wrap). Every `yes` spelling is checked against torch on the CPU over edge inputs by "
        "`tests/frontend/test_ops.py`, compiled with NVRTC by `tests/codegen/test_ops_compile.py` "
        "and checked against torch on CUDA by `tests/gpu/test_ops_gpu.py`. Ops that are not "
        "elementwise (reductions, views, shaped creation) have no meaning per position and are "
        "not listed.",
        "",
        f"{n_yes} ops are supported.",
    ]
    for heading, rs in rows().items():
        lines += ["", f"## {heading}", "", "| op | supported | spellings | notes |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | {status} | {sp} | {note} |" for name, status, sp, note in rs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/ops.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is stale: run python -m scripts.ops_table", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
