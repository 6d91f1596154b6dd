"""The one IR printer: infix expressions, with `let` bindings for shared subexpressions.

Used by `repr(node)`, `attncc explain`, error messages and tests, so IR always looks the same.

Example:
    >>> from attncc.ir.nodes import var, const
    >>> print(format_expr((var("q_idx") - var("kv_idx")) * 2))
    (q_idx - kv_idx) * 2
    >>> d = var("q_idx") - var("kv_idx")
    >>> print(format_hook("mask_mod", (d >= 0) & (d < 8)))
    mask_mod -> bool:
      let t0 = q_idx - kv_idx
      return (t0 >= 0) & (t0 < 8)
"""
from __future__ import annotations

from collections import Counter

from .nodes import Node, op_info, walk

# Binding power for parenthesisation; higher binds tighter (Python's precedence order).
_PREC = {"or": 1, "and": 2, "not": 3, "lt": 4, "le": 4, "gt": 4, "ge": 4, "eq": 4, "ne": 4,
         "add": 6, "sub": 6, "mul": 7, "div": 7, "floordiv": 7, "mod": 7, "neg": 8, "pow": 9}
_ATOM = 10


def _const_text(n: Node) -> str:
    v = n.attr
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        text = repr(v)
        return text if ("." in text or "e" in text) else text + ".0"
    return str(v)


def _shared(root: Node) -> list[Node]:
    """Non-leaf nodes used more than once: these get `let` names."""
    uses: Counter[int] = Counter()
    order = list(walk(root))
    for n in order:
        for a in n.args:
            uses[id(a)] += 1
    return [n for n in order if n.args and uses[id(n)] > 1 and n.op not in ("neg",)]


def format_expr(root: Node, names: dict[int, str] | None = None) -> str:
    """One node as infix text; `names` maps node ids to already-bound names."""
    names = names or {}

    def go(n: Node, top: bool = False) -> tuple[str, int]:
        if not top and id(n) in names:
            return names[id(n)], _ATOM
        info = op_info(n.op)
        if n.op == "var" or n.op == "param":
            return str(n.attr), _ATOM
        if n.op == "const":
            text = _const_text(n)
            return text, (_ATOM if not text.startswith("-") else _PREC["neg"])
        if n.op == "load":
            return f"{n.attr}[{', '.join(go(a)[0] for a in n.args)}]", _ATOM
        if n.op == "vec":
            return f"{n.attr}[{go(n.args[0])[0]}]", _ATOM
        if n.op == "neg":
            return "-" + wrap(n.args[0], _PREC["neg"]), _PREC["neg"]
        if n.op == "not":
            return "~" + wrap(n.args[0], _ATOM), _PREC["not"]
        if info.symbol and len(n.args) == 2:
            p = _PREC[n.op]
            # comparisons and logic ops parenthesise their operands for readability
            lp = p if n.op not in ("pow",) else p + 1
            rp = p + 1 if n.op not in ("pow",) else p
            if info.kind in ("compare", "logic"):
                lp = rp = _ATOM if info.kind == "logic" else p + 1
            return f"{wrap(n.args[0], lp)} {info.symbol} {wrap(n.args[1], rp)}", p
        if n.op == "where":
            c, a, b = (go(x)[0] for x in n.args)
            return f"where({c}, {a}, {b})", _ATOM
        if n.op in ("to_f32", "to_i32"):
            return f"{n.op[3:]}({go(n.args[0])[0]})", _ATOM
        return f"{n.op}({', '.join(go(a)[0] for a in n.args)})", _ATOM

    def wrap(n: Node, need: int) -> str:
        text, prec = go(n)
        return text if prec >= need else f"({text})"

    return go(root, top=True)[0] if id(root) not in names else names[id(root)]


def format_hook(name: str, root: Node) -> str:
    """A hook as `let` lines plus `return`, naming every shared subexpression once."""
    names: dict[int, str] = {}
    lines = [f"{name} -> {root.dtype.value}:"]
    for i, n in enumerate(_shared(root)):
        if n is root:
            continue
        text = format_expr(n, names)
        names[id(n)] = f"t{i}"
        lines.append(f"  let t{i} = {text}")
    lines.append(f"  return {format_expr(root, names) if id(root) not in names else names[id(root)]}")
    return "\n".join(lines)
