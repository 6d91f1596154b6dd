"""The `.attn` text language: parse a variant written as text and lower it to attncc IR.

A `.attn` file lowers to exactly the IR the Python frontend builds for the same variant (same
typing rules, same interned nodes), so `q_idx >= kv_idx` here and in a Python mask_mod are the
very same `Node`. Grammar: attncc/frontend/attn.lark.

    # sliding-window softcap attention
    variant softcap_window(cap: f32 = 30.0, window: i32 = 256, slopes: tensor f32[H])
    normalize softmax
    let rel = q_idx - kv_idx
    score_mod = cap * tanh(score / cap) - slopes[h] * rel
    mask_mod  = (q_idx >= kv_idx) & (rel < window)

- Scalar parameters (`i32`/`f32`, optional default) become kernel parameters (`param` nodes);
  defaults go to `Bindings.scalars`. Tensor parameters (`tensor f32[H, S]`, element types
  f32 f16 bf16 f64 i32 i64 i16 i8 u8 bool) become `load`s; their tensors are bound later.
- `let NAME = expr` names a subexpression; a hook may use a let only if it has every variable the
  let reads.
- Expressions: + - * / // % **, comparisons, & | ^ ~ (booleans only; they bind looser than
  comparisons), where(c, a, b), tanh exp exp2 log log2 sigmoid abs sqrt rsqrt sin cos floor
  min max pow clamp(x, lo, hi), casts f32() i32() bool(), constants true false inf nan pi.
  Operations on constants alone are evaluated while parsing, with Python's arithmetic, so
  `-inf`, `1 / 8` and `2 ** 3` are plain constants exactly as they are in a Python mod.
- Head vectors: `q[i]` in query_mod, `k[i]` in key_mod, `v[i]` in value_mod, `o[i]` in output_mod.

Example:
    >>> ir, bind = parse_attn('''
    ... variant prefix_lm(prefix: i32 = 128)
    ... mask_mod = (kv_idx < prefix) | (q_idx >= kv_idx)
    ... ''')
    >>> print(ir.format())
    variant prefix_lm (normalize=softmax)
    param prefix: i32
    mask_mod -> bool:
      return (kv_idx < prefix) | (q_idx >= kv_idx)
    >>> bind.scalars
    {'prefix': 128}
"""
from __future__ import annotations

import difflib
import functools
import math
import operator
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Iterator, NoReturn

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ..errors import AttnSyntaxError
from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32, DType, Node
from ..ir.program import (HOOK_ORDER, HOOK_SIGNATURES, Bindings, Hook, ScalarParam, SourceLoc,
                          TensorParam, VariantIR, ir_dtype_for_elem)

__all__ = ["parse_attn", "load_attn"]

# ----------------------------------------------------------------------------- the parser


class _BracketNewlines:
    """Lark post-lexer: drop newlines inside ( ) and [ ] so expressions may wrap lines."""

    always_accept = ("_NL",)  # the contextual lexer must always recognise newlines

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    """The LALR parser, built once per process (grammar analysis is the slow part)."""
    grammar = resources.files("attncc.frontend").joinpath("attn.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True,
                postlex=_BracketNewlines())


# ----------------------------------------------------------------------------- error reporting


@dataclass(frozen=True)
class _Pos:
    """A 1-based source span on one line: where a caret goes."""

    line: int
    column: int
    width: int = 1


def _pos(x: Tree | Token) -> _Pos:
    if isinstance(x, Token):
        return _Pos(x.line or 1, x.column or 1, max(1, len(x.value.rstrip("\r\n"))))
    m = x.meta
    width = m.end_column - m.column if m.end_line == m.line else 10**6
    return _Pos(m.line, m.column, max(1, width))


class _Source:
    """The text being parsed, for `file:line:column` messages with the line and a caret."""

    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        self.lines = text.splitlines()

    def snippet(self, pos: _Pos) -> str:
        text = self.lines[pos.line - 1] if 0 < pos.line <= len(self.lines) else ""
        col = max(1, min(pos.column, len(text) + 1))
        width = max(1, min(pos.width, len(text) - col + 1))
        # keep tabs so the caret lines up under tab-indented source
        pad = "".join(c if c == "\t" else " " for c in text[:col - 1])
        num = str(pos.line)
        return (f" {num} | {text}\n"
                f" {' ' * len(num)} | {pad}^{'~' * (width - 1)}")

    def error(self, msg: str, pos: _Pos, hint: str | None = None,
              notes: tuple[tuple[str, _Pos], ...] = ()) -> AttnSyntaxError:
        parts = [f"{self.filename}:{pos.line}:{pos.column}: error: {msg}", self.snippet(pos)]
        for note, at in notes:
            parts.append(f"{self.filename}:{at.line}:{at.column}: note: {note}")
            parts.append(self.snippet(at))
        if hint:
            parts.append(f"hint: {hint}")
        return AttnSyntaxError("\n".join(parts))


# How terminals read in "expected ..." lists.
_TERMINAL_WORDS = {"NAME": "a name", "INT": "a number", "FLOAT": "a number", "_NL": "end of line",
                   "$END": "end of file"}
_EXPR_START = frozenset({"NAME", "INT", "FLOAT", "LPAR", "MINUS", "PLUS"})
_BINARY_OPS = frozenset({"PLUS", "MINUS", "STAR", "SLASH", "DSLASH", "PERCENT", "DSTAR", "EQEQ",
                         "NE", "LT", "LE", "GT", "GE", "AMP", "BAR", "CARET"})


def _terminal_word(parser: Lark, name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        pattern = parser.get_terminal(name).pattern
    except KeyError:
        return name
    if pattern.type == "str":
        return f"'{pattern.value}'"
    return name.lower()


def _expected_words(parser: Lark, expected: set[str]) -> str:
    names = set(expected)
    words: list[str] = []
    if _EXPR_START <= names:
        words.append("an expression")
        names -= _EXPR_START | {"TILDE"}
    if _BINARY_OPS <= names:
        words.append("an operator")
        names -= _BINARY_OPS
    words += sorted({_terminal_word(parser, n) for n in names})
    if not words:
        return ""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _token_text(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    kind = {"NAME": "name", "INT": "number", "FLOAT": "number"}.get(tok.type)
    return f"{kind} '{tok.value}'" if kind else f"'{tok.value}'"


def _parse_hint(tok_type: str, value: str, expected: set[str]) -> str | None:
    if tok_type == "NAME" and value in ("and", "or", "not"):
        return "combine conditions with & | ~ (e.g. (q_idx >= kv_idx) & (h < 4)), not and/or/not"
    if tok_type == "NAME" and value in ("if", "else"):
        return "write a choice as where(cond, a, b)"
    if value == "=" and "EQEQ" in expected:
        return "compare with '=='; '=' only starts a hook, let or default value"
    if value in ("'", '"'):
        return "the .attn language has no strings"
    if value == ".":
        return "call functions directly (tanh(x), not torch.tanh(x) or x.tanh())"
    if value == "!":
        return "negate a condition with ~, e.g. ~(q_idx < kv_idx)"
    if value in ("?", ":"):
        return "write a choice as where(cond, a, b)"
    if tok_type == "$END" or tok_type == "_NL":
        if "RPAR" in expected or "RSQB" in expected:
            return "a '(' or '[' is not closed"
    return None


def _acceptable(e: UnexpectedInput, fallback: set[str]) -> set[str]:
    """Terminals the parser would really take here. LALR's own expected set merges states, so
    it lists ')' even where no '(' is open; asking the interactive parser is exact."""
    ip = getattr(e, "interactive_parser", None)
    if ip is None:
        return fallback
    try:
        return set(ip.accepts())
    except Exception:  # pragma: no cover - lark internals; the merged set is still correct-ish
        return fallback


def _syntax_error(src: _Source, text: str, e: UnexpectedInput) -> AttnSyntaxError:
    parser = _parser()
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        allowed = _acceptable(e, set(e.allowed or ()))
        expected = _expected_words(parser, allowed)
        msg = f"unexpected character {ch!r}" + (f"; expected {expected}" if expected else "")
        return src.error(msg, _Pos(e.line, e.column), _parse_hint("CHAR", ch, allowed))
    if isinstance(e, UnexpectedToken):
        tok = e.token
        expected = _acceptable(e, set(e.expected or ()))
        if tok.type == "$END":
            line = len(src.lines) or 1
            pos = _Pos(line, len(src.lines[line - 1]) + 1 if src.lines else 1)
        else:
            pos = _pos(tok)
        words = _expected_words(parser, expected)
        msg = f"unexpected {_token_text(tok)}" + (f"; expected {words}" if words else "")
        return src.error(msg, pos, _parse_hint(tok.type, str(tok.value), expected))
    line, col = getattr(e, "line", 1) or 1, getattr(e, "column", 1) or 1
    return src.error(f"cannot parse: {e}", _Pos(line, col))


# ----------------------------------------------------------------------------- names and tables

_SCALAR_TYPES = {"i32": I32, "f32": F32}
_TENSOR_ELEMS = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
                 "i32": "int32", "i64": "int64", "i16": "int16", "i8": "int8", "u8": "uint8",
                 "bool": "bool"}
_TENSOR_ELEMS.update({v: v for v in list(_TENSOR_ELEMS.values())})
_CONSTANTS: dict[str, bool | float] = {"true": True, "false": False, "True": True, "False": False,
                                       "inf": math.inf, "nan": math.nan, "pi": math.pi}
_UNARY_FNS = ("abs", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin",
              "cos", "floor")
_FUNCTION_ARITY = {**{f: 1 for f in _UNARY_FNS}, "min": 2, "max": 2, "pow": 2, "clamp": 3,
                   "where": 3, "f32": 1, "i32": 1, "bool": 1}
_VECTOR_OF = {HOOK_SIGNATURES[h][2]: h for h in HOOK_ORDER if HOOK_SIGNATURES[h][2]}
_VECTOR_WORD = {"q": "query", "k": "key", "v": "value", "o": "output"}
_ALL_VARS = tuple(N.VAR_TYPES)
# Python spellings people will reach for, and what to write instead.
_SPELLING_HINTS = {"float": "f32(x)", "int": "i32(x)", "minimum": "min(a, b)",
                   "maximum": "max(a, b)", "torch": "call functions directly, e.g. tanh(x)",
                   "math": "call functions directly, e.g. sqrt(x)", "None": "a number"}
_OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floordiv", "%": "mod",
             "**": "pow", "&": "and", "|": "or", "^": "xor", "<": "lt", "<=": "le", ">": "gt",
             ">=": "ge", "==": "eq", "!=": "ne"}
_RESERVED = (set(N.VAR_TYPES) | set(_VECTOR_OF) | set(_FUNCTION_ARITY) | set(_CONSTANTS)
             | set(HOOK_ORDER))


def _sigmoid(x: float) -> float:
    # two branches so large |x| never overflows math.exp
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


# Python evaluation of each op on constant operands (operands already promoted by the builders).
_EVAL: dict[str, Callable[..., Any]] = {
    "neg": operator.neg, "abs": abs, "exp": math.exp, "exp2": lambda x: 2.0 ** x,
    "log": math.log, "log2": math.log2, "tanh": math.tanh, "sigmoid": _sigmoid,
    "sqrt": math.sqrt, "rsqrt": lambda x: 1.0 / math.sqrt(x), "sin": math.sin, "cos": math.cos,
    "floor": lambda x: float(math.floor(x)) if math.isfinite(x) else x,
    "not": operator.not_, "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "div": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
    "pow": operator.pow, "min": min, "max": max, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b,
    "where": lambda c, a, b: a if c else b,
}


# ----------------------------------------------------------------------------- lowering


@dataclass
class _Let:
    node: Node
    pos: _Pos
    # variables / head vectors the let reads -> where (first occurrence, in its own text)
    uses: dict[str, _Pos] = field(default_factory=dict)


@dataclass
class _Ctx:
    """Where an expression is being lowered: a hook, a let, or a parameter default."""

    kind: str  # "hook" | "let" | "default"
    hook: str = ""
    uses: dict[str, _Pos] = field(default_factory=dict)  # for lets: what they read

    @property
    def vars(self) -> tuple[str, ...]:
        if self.kind == "hook":
            return HOOK_SIGNATURES[self.hook][1]
        return _ALL_VARS if self.kind == "let" else ()

    @property
    def vector(self) -> str | None:
        return HOOK_SIGNATURES[self.hook][2] if self.kind == "hook" else None


def _hooks_with(var: str) -> str:
    return ", ".join(h for h in HOOK_ORDER if var in HOOK_SIGNATURES[h][1])


def _short_path(path: str) -> str:
    # as the user named it when relative; the last two components when absolute (like the
    # Python frontend), so generated code does not embed machine-specific directories
    if path.startswith("<") or not os.path.isabs(path):
        return path
    parts = os.path.abspath(path).split(os.sep)
    return os.sep.join(parts[-2:])


class _Lowerer:
    """Walks the parse tree of one file and builds VariantIR + Bindings."""

    def __init__(self, src: _Source) -> None:
        self.src = src
        self.name: str | None = None
        self.normalize = "softmax"
        self.scalars: dict[str, tuple[DType, _Pos]] = {}
        self.defaults: dict[str, bool | int | float] = {}
        self.tensors: dict[str, tuple[TensorParam, _Pos]] = {}
        self.lets: dict[str, _Let] = {}
        self.hooks: dict[str, tuple[Node, _Pos]] = {}
        self.header_pos: _Pos | None = None
        self.normalize_pos: _Pos | None = None

    def fail(self, msg: str, at: Tree | Token | _Pos, hint: str | None = None,
             notes: tuple[tuple[str, _Pos], ...] = ()) -> NoReturn:
        raise self.src.error(msg, at if isinstance(at, _Pos) else _pos(at), hint, notes)

    # -- statements

    def run(self, tree: Tree) -> tuple[VariantIR, Bindings]:
        for i, stmt in enumerate(tree.children):
            if stmt.data == "variant_decl":
                self.variant_decl(stmt, first=(i == 0))
            elif stmt.data == "normalize_stmt":
                self.normalize_stmt(stmt)
            elif stmt.data == "let_stmt":
                self.let_stmt(stmt)
            elif stmt.data == "hook_stmt":
                self.hook_stmt(stmt)
            else:  # pragma: no cover - the grammar has no other statements
                raise AssertionError(stmt.data)
        return self.finish()

    def check_new_name(self, tok: Token, what: str) -> None:
        name = str(tok)
        if name in _RESERVED:
            self.fail(f"'{name}' is a built-in name and cannot name a {what}", tok,
                      "pick another name")
        for table, kind in ((self.scalars, "parameter"), (self.tensors, "tensor parameter"),
                            (self.lets, "let")):
            if name in table:
                prev = table[name]
                where = prev[1] if isinstance(prev, tuple) else prev.pos  # type: ignore[union-attr]
                self.fail(f"'{name}' is already defined (as a {kind})", tok,
                          notes=((f"'{name}' was defined here", where),))

    def variant_decl(self, stmt: Tree, first: bool) -> None:
        name_tok = stmt.children[0]
        if self.header_pos is not None:
            self.fail("a file holds one variant; this is a second `variant` line", name_tok,
                      notes=(("the variant was declared here", self.header_pos),))
        if not first:
            self.fail("the `variant` line must come first (before lets, hooks and normalize)",
                      name_tok)
        self.header_pos = _pos(name_tok)
        self.name = str(name_tok)
        for p in stmt.children[1:]:
            if isinstance(p, Tree):
                (self.scalar_param if p.data == "scalar_param" else self.tensor_param)(p)

    def scalar_param(self, p: Tree) -> None:
        name_tok, type_tok, default = p.children
        self.check_new_name(name_tok, "parameter")
        t = str(type_tok)
        if t not in _SCALAR_TYPES:
            hint = ("boolean parameters are not supported: use an i32 parameter (0 or 1) or "
                    "a constant" if t == "bool" else
                    "tensor parameters are written `name: tensor f32[H]`" if t in _TENSOR_ELEMS
                    else None)
            self.fail(f"unknown parameter type '{t}'; scalar parameters are i32 or f32",
                      type_tok, hint)
        dtype = _SCALAR_TYPES[t]
        self.scalars[str(name_tok)] = (dtype, _pos(name_tok))
        if default is not None:
            node = self.expr(default, _Ctx("default"))
            if node.op != "const":
                self.fail(f"the default of '{name_tok}' must be a constant", default)
            v = node.attr
            if dtype is I32:
                if node.dtype is not I32:
                    self.fail(f"'{name_tok}' is i32 but its default is a {node.dtype.value}",
                              default, f"write an integer, or declare `{name_tok}: f32`")
                self.defaults[str(name_tok)] = int(v)
            else:
                if node.dtype is BOOL:
                    self.fail(f"'{name_tok}' is f32 but its default is a bool", default)
                self.defaults[str(name_tok)] = float(v)

    def tensor_param(self, p: Tree) -> None:
        name_tok, elem_tok = p.children[0], p.children[1]
        self.check_new_name(name_tok, "tensor parameter")
        elem = _TENSOR_ELEMS.get(str(elem_tok))
        if elem is None:
            self.fail(f"unknown tensor element type '{elem_tok}'", elem_tok,
                      "use one of f32 f16 bf16 f64 i32 i64 i16 i8 u8 bool")
        dims = [c for c in p.children[2:] if isinstance(c, Token) and c.type in ("NAME", "INT")]
        dtype = ir_dtype_for_elem(elem)
        assert dtype is not None
        self.tensors[str(name_tok)] = (TensorParam(str(name_tok), elem, len(dims), dtype),
                                       _pos(name_tok))

    def normalize_stmt(self, stmt: Tree) -> None:
        tok = stmt.children[0]
        if self.normalize_pos is not None:
            self.fail("`normalize` is given twice", tok,
                      notes=(("first given here", self.normalize_pos),))
        if str(tok) not in ("softmax", "none"):
            self.fail(f"unknown normalization '{tok}'", tok,
                      "use `normalize softmax` (the default) or `normalize none` (output = "
                      "sum of score_mod(...) * v, e.g. sigmoid attention)")
        self.normalize, self.normalize_pos = str(tok), _pos(tok)

    def let_stmt(self, stmt: Tree) -> None:
        name_tok, value = stmt.children
        self.check_new_name(name_tok, "let")
        ctx = _Ctx("let")
        node = self.expr(value, ctx)
        self.lets[str(name_tok)] = _Let(node, _pos(name_tok), ctx.uses)

    def hook_stmt(self, stmt: Tree) -> None:
        name_tok, value = stmt.children
        hook = str(name_tok)
        if hook not in HOOK_SIGNATURES:
            close = difflib.get_close_matches(hook, HOOK_ORDER, n=1)
            hint = (f"did you mean '{close[0]}'?" if close else
                    f"'{hook}' is a let, which cannot be reassigned" if hook in self.lets else
                    f"to name a value, write `let {hook} = ...`")
            self.fail(f"unknown hook '{hook}'; hooks are {', '.join(HOOK_ORDER)}", name_tok, hint)
        if hook in self.hooks:
            self.fail(f"{hook} is given twice", name_tok,
                      notes=(("first given here", self.hooks[hook][1]),))
        node = self.expr(value, _Ctx("hook", hook))
        depth = _ir_depth(node)
        if depth > MAX_DEPTH:  # deep through lets: each was shallow enough alone
            self.fail(f"{hook} nests {depth} operations deep (through its lets); attncc "
                      f"compiles at most {MAX_DEPTH}", value, _DEPTH_HINT)
        if hook == "mask_mod":
            if node.dtype is not BOOL:
                self.fail(f"mask_mod must be a boolean, but this expression is "
                          f"{node.dtype.value}", value,
                          "return a comparison, e.g. q_idx >= kv_idx")
        else:
            if node.dtype is BOOL:
                self.fail(f"{hook} must be a number, but this expression is a boolean", value,
                          "masks belong in mask_mod; for a choice use where(cond, a, b)")
            node = N.cast(node, F32)
        self.hooks[hook] = (node, _pos(name_tok))

    def finish(self) -> tuple[VariantIR, Bindings]:
        # keep only what the hooks read, in first-use order, exactly as the Python tracer does
        used_params: list[str] = []
        used_tensors: list[str] = []
        for hook in HOOK_ORDER:
            if hook not in self.hooks:
                continue
            for n in N.walk(self.hooks[hook][0]):
                if n.op == "param" and n.attr not in used_params:
                    used_params.append(n.attr)
                if n.op == "load" and n.attr not in used_tensors:
                    used_tensors.append(n.attr)
        file = _short_path(self.src.filename)
        hooks = {h: Hook(h, self.hooks[h][0], SourceLoc(file, self.hooks[h][1].line, h))
                 for h in HOOK_ORDER if h in self.hooks}
        name = self.name
        if name is None:
            stem = os.path.splitext(os.path.basename(self.src.filename))[0]
            name = stem if stem.isidentifier() else "anonymous"
        ir = VariantIR(hooks=hooks, normalize=self.normalize, name=name,
                       scalars=tuple(ScalarParam(p, self.scalars[p][0]) for p in used_params),
                       tensors=tuple(self.tensors[t][0] for t in used_tensors))
        bindings = Bindings(scalars={p: self.defaults[p] for p in used_params
                                     if p in self.defaults})
        return ir, bindings

    # -- expressions

    def expr(self, t: Tree | Token, ctx: _Ctx) -> Node:
        kind = t.data if isinstance(t, Tree) else "token"
        if kind == "number":
            return self.number(t.children[0])
        if kind == "name":
            return self.name_ref(t.children[0], ctx)
        if kind == "paren":
            return self.expr(t.children[1], ctx)
        if kind == "binop":
            return self.binop(t, ctx)
        if kind == "compare":
            return self.compare(t, ctx)
        if kind == "unop":
            return self.unop(t, ctx)
        if kind == "call":
            return self.call(t, ctx)
        if kind == "index":
            return self.index(t, ctx)
        raise AssertionError(f"unexpected parse node {kind}")  # pragma: no cover

    def number(self, tok: Token) -> Node:
        if tok.type == "FLOAT":
            return N.const(float(tok))
        value = int(tok)
        if not -(2**31) <= value < 2**31:
            self.fail(f"the integer {value} does not fit in 32 bits", tok,
                      "use a smaller constant, or a float like 1e12")
        return N.const(value)

    def folded(self, node: Node, at: Tree | Token) -> Node:
        """Evaluate an op whose operands are all constants, as Python would in a traced mod."""
        if not node.args or not all(a.op == "const" for a in node.args):
            return node
        try:
            value = _EVAL[node.op](*(a.attr for a in node.args))
        except (ZeroDivisionError, ValueError, OverflowError) as e:
            self.fail(f"this constant expression has no value ({e})", at)
        if isinstance(value, complex):  # (-8.0) ** 0.5: leave it to the kernel (NaN there too)
            return node
        try:
            return N.const(value, node.dtype)
        except N.IRTypeError as e:
            self.fail(str(e), at)

    def name_ref(self, tok: Token, ctx: _Ctx) -> Node:
        name = str(tok)
        if name in self.lets:
            return self.use_let(tok, self.lets[name], ctx)
        if name in self.scalars:
            if ctx.kind == "default":
                self.fail("a default value must be a constant, not another parameter", tok)
            return N.param(name, self.scalars[name][0])
        if name in self.tensors:
            tp = self.tensors[name][0]
            if ctx.kind == "default":
                self.fail("a default value must be a constant", tok)
            if tp.ndim:
                dims = ", ".join(("h", "q_idx", "kv_idx", "b")[:tp.ndim]) if tp.ndim <= 4 else "..."
                self.fail(f"'{name}' is a tensor of rank {tp.ndim}; read one element of it", tok,
                          f"index every dimension, e.g. {name}[{dims}]")
            return N.load(name, (), tp.dtype)
        if name in N.VAR_TYPES:
            self.check_var(tok, name, ctx)
            return N.var(name)
        if name in _VECTOR_OF:
            self.check_vector(tok, name, ctx)
            self.fail(f"'{name}' is the {_VECTOR_WORD[name]} head vector; read one element of it",
                      tok, f"write {name}[d] for this position, or e.g. {name}[(d + 32) % 64]")
        if name in _CONSTANTS:
            return N.const(_CONSTANTS[name])
        if name in _FUNCTION_ARITY:
            self.fail(f"'{name}' is a function; call it", tok, f"write {name}(...)")
        self.unknown(tok)

    def unknown(self, tok: Token) -> NoReturn:
        name = str(tok)
        known = (list(self.lets) + list(self.scalars) + list(self.tensors) + list(N.VAR_TYPES)
                 + list(_CONSTANTS))
        if name in _SPELLING_HINTS:
            hint = f"write {_SPELLING_HINTS[name]}"
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = (f"did you mean '{close[0]}'?" if close else
                    "declare parameters in the variant line, e.g. "
                    f"`variant my_variant({name}: f32 = 1.0)`, or define it with "
                    f"`let {name} = ...`")
        self.fail(f"unknown name '{name}'", tok, hint)

    def check_var(self, tok: Token, name: str, ctx: _Ctx) -> None:
        if ctx.kind == "let":
            ctx.uses.setdefault(name, _pos(tok))
            return
        if name in ctx.vars:
            return
        if ctx.kind == "default":
            self.fail(f"a default value must be a constant; '{name}' varies per position", tok)
        self.fail(f"{ctx.hook} cannot read '{name}' (it reads {', '.join(ctx.vars)})", tok,
                  f"'{name}' exists in {_hooks_with(name)}")

    def check_vector(self, tok: Token, name: str, ctx: _Ctx) -> None:
        if ctx.kind == "let":
            ctx.uses.setdefault(name, _pos(tok))
            return
        if ctx.vector == name:
            return
        owner = _VECTOR_OF[name]
        if ctx.kind == "default":
            self.fail("a default value must be a constant", tok)
        self.fail(f"{ctx.hook} cannot read '{name}': the {_VECTOR_WORD[name]} head vector exists "
                  f"only in {owner}", tok,
                  f"{ctx.hook} reads {', '.join(ctx.vars)}" +
                  (f" and its vector {ctx.vector}" if ctx.vector else ""))

    def use_let(self, tok: Token, let: _Let, ctx: _Ctx) -> Node:
        if ctx.kind == "let":
            for k, at in let.uses.items():
                ctx.uses.setdefault(k, at)
            return let.node
        for k, at in let.uses.items():
            allowed = (k == ctx.vector) if k in _VECTOR_OF else (k in ctx.vars)
            if not allowed:
                what = "" if ctx.kind == "default" else f"{ctx.hook} "
                avail = (f"the {_VECTOR_WORD[k]} head vector exists only in {_VECTOR_OF[k]}"
                         if k in _VECTOR_OF else f"'{k}' exists in {_hooks_with(k)}")
                if ctx.kind == "default":
                    self.fail(f"a default value must be a constant; let '{tok}' reads '{k}'", tok,
                              notes=((f"'{tok}' reads '{k}' here", at),))
                self.fail(f"{what}cannot use let '{tok}': it reads '{k}', which {ctx.hook} does "
                          f"not have", tok, avail, notes=((f"'{tok}' reads '{k}' here", at),))
        return let.node

    def binop(self, t: Tree, ctx: _Ctx) -> Node:
        left, op_tok, right = t.children
        a, b = self.expr(left, ctx), self.expr(right, ctx)
        op = _OP_NAMES[str(op_tok)]
        if op in ("and", "or", "xor"):
            for side, n in (("left", a), ("right", b)):
                if n.dtype is not BOOL:
                    self.fail(f"'{op_tok}' combines booleans, but its {side} operand is "
                              f"{n.dtype.value}", op_tok,
                              "compare first, e.g. (q_idx >= kv_idx) & (h < 4); & | ^ are not "
                              "bitwise integer operators here")
            if op == "xor":  # a ^ b on booleans is a != b, as in the Python frontend
                return self.folded(N.binary("ne", a, b), t)
        if op == "pow" and a.op == b.op == "const" and a.dtype is I32 and b.dtype is I32 \
                and b.attr >= 0:
            # Python keeps 2 ** 3 an integer; mirror that for literal-only powers
            value = a.attr ** b.attr
            if not -(2**31) <= value < 2**31:
                self.fail(f"{a.attr} ** {b.attr} does not fit in 32 bits", t)
            return N.const(value)
        return self.folded(N.binary(op, a, b), t)

    def compare(self, t: Tree, ctx: _Ctx) -> Node:
        left, op_tok, right = t.children
        if isinstance(left, Tree) and left.data == "compare":
            self.fail("comparisons cannot be chained", op_tok,
                      "write (a < b) & (b < c) for a < b < c")
        a, b = self.expr(left, ctx), self.expr(right, ctx)
        return self.folded(N.binary(_OP_NAMES[str(op_tok)], a, b), t)

    def unop(self, t: Tree, ctx: _Ctx) -> Node:
        op_tok, operand = t.children
        if op_tok == "-" and isinstance(operand, Tree) and operand.data == "number" \
                and operand.children[0].type == "INT":
            # -2147483648 is a valid i32 even though 2147483648 alone is not
            value = -int(operand.children[0])
            if not -(2**31) <= value < 2**31:
                self.fail(f"the integer {value} does not fit in 32 bits", t)
            return N.const(value)
        x = self.expr(operand, ctx)
        if op_tok == "+":
            return x
        if op_tok == "-":
            return self.folded(N.unary("neg", x), t)
        if x.dtype is not BOOL:
            self.fail(f"'~' negates a boolean, but its operand is {x.dtype.value}", op_tok,
                      "negate a comparison, e.g. ~(q_idx < kv_idx); for numbers use -x")
        return self.folded(N.unary("not", x), t)

    def call(self, t: Tree, ctx: _Ctx) -> Node:
        fn_tok = t.children[0]
        arg_trees = [c for c in t.children[1:] if c is not None and
                     not (isinstance(c, Token) and c.type in ("LPAR", "RPAR"))]
        fn = str(fn_tok)
        if fn not in _FUNCTION_ARITY:
            if fn in self.lets or fn in self.scalars or fn in self.tensors or fn in N.VAR_TYPES \
                    or fn in _VECTOR_OF or fn in _CONSTANTS:
                self.fail(f"'{fn}' is not a function", fn_tok,
                          f"index tensors and head vectors with [ ], e.g. {fn}[h]"
                          if fn in self.tensors or fn in _VECTOR_OF else None)
            close = difflib.get_close_matches(fn, list(_FUNCTION_ARITY), n=1)
            hint = (f"write {_SPELLING_HINTS[fn]}" if fn in _SPELLING_HINTS else
                    f"did you mean '{close[0]}'?" if close else
                    f"functions: {', '.join(sorted(_FUNCTION_ARITY))}")
            self.fail(f"unknown function '{fn}'", fn_tok, hint)
        want = _FUNCTION_ARITY[fn]
        if len(arg_trees) != want:
            self.fail(f"{fn}() takes {want} argument{'s' if want > 1 else ''}, "
                      f"got {len(arg_trees)}", fn_tok,
                      "write clamp(x, lo, hi)" if fn == "clamp" else None)
        args = [self.expr(a, ctx) for a in arg_trees]
        if fn in ("f32", "i32", "bool"):
            return N.cast(args[0], {"f32": F32, "i32": I32, "bool": BOOL}[fn])
        if fn in _UNARY_FNS:
            x = args[0]
            if fn == "floor" and x.dtype is not F32:
                return x  # floor of an integer is itself (as torch.floor keeps the dtype)
            return self.folded(N.unary(fn, x), t)
        if fn in ("min", "max", "pow"):
            return self.folded(N.binary(fn, args[0], args[1]), t)
        if fn == "clamp":
            lo = self.folded(N.binary("max", args[0], args[1]), t)
            return self.folded(N.binary("min", lo, args[2]), t)
        # where
        if args[0].dtype is not BOOL:
            self.fail(f"where()'s condition must be a boolean, but it is {args[0].dtype.value}",
                      arg_trees[0], "pass a comparison, e.g. where(q_idx >= kv_idx, score, -inf)")
        return self.folded(N.where(*args), t)

    def index(self, t: Tree, ctx: _Ctx) -> Node:
        name_tok = t.children[0]
        idx_trees = [c for c in t.children[1:] if c is not None and
                     not (isinstance(c, Token) and c.type in ("LSQB", "RSQB"))]
        name = str(name_tok)
        if name in _VECTOR_OF:
            self.check_vector(name_tok, name, ctx)
            if len(idx_trees) != 1:
                self.fail(f"the head vector {name} takes one index", name_tok,
                          f"write {name}[d] or e.g. {name}[(d + 32) % 64]")
            i = self.index_value(idx_trees[0], ctx, name)
            return N.vec(name, i)
        if name in self.tensors:
            if ctx.kind == "default":
                self.fail("a default value must be a constant", name_tok)
            tp = self.tensors[name][0]
            if len(idx_trees) != tp.ndim:
                self.fail(f"'{name}' has rank {tp.ndim} but is indexed with {len(idx_trees)} "
                          f"index(es)", name_tok,
                          f"read single elements: index all {tp.ndim} dimension(s)")
            return N.load(name, tuple(self.index_value(i, ctx, name) for i in idx_trees),
                          tp.dtype)
        if name in self.lets or name in self.scalars or name in N.VAR_TYPES or \
                name in _CONSTANTS or name in _FUNCTION_ARITY:
            self.fail(f"'{name}' cannot be indexed", name_tok,
                      "only tensor parameters and head vectors (q in query_mod, ...) take [ ]")
        self.unknown(name_tok)

    def index_value(self, t: Tree | Token, ctx: _Ctx, of: str) -> Node:
        n = self.expr(t, ctx)
        if n.dtype is F32:
            self.fail(f"an index into '{of}' must be an integer, but this is f32", t,
                      "use // instead of /, or convert with i32(x)")
        if n.dtype is BOOL:
            self.fail(f"an index into '{of}' must be an integer, but this is a boolean", t,
                      "index with integer expressions of b, h, q_idx, kv_idx, d")
        return n


# Deepest expression attncc takes: lowering here and the IR passes after it (simplify, codegen)
# recurse once or twice per level, within Python's default recursion limit of 1000.
MAX_DEPTH = 256
_DEPTH_HINT = ("group long sums and products in balanced parentheses, e.g. "
               "(a + b) + (c + d) instead of a + b + c + d, or compute a long series outside "
               "and pass it in as a tensor parameter")


def _check_depth(src: _Source, tree: Tree) -> None:
    """An AttnSyntaxError at the first subtree nested past MAX_DEPTH (found without recursion)."""
    stack: list[tuple[Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise src.error(f"expression too deeply nested (more than {MAX_DEPTH} levels)",
                            _pos(node), _DEPTH_HINT)
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))


def _ir_depth(root: Node) -> int:
    """Levels of the IR expression `root` (a leaf is 1)."""
    depth: dict[int, int] = {}
    for n in N.walk(root):  # children before parents
        depth[id(n)] = 1 + max((depth[id(a)] for a in n.args), default=0)
    return depth[id(root)]


# ----------------------------------------------------------------------------- API


def parse_attn(text: str, filename: str = "<string>") -> tuple[VariantIR, Bindings]:
    """Parse `.attn` source text into IR and the parameter defaults.

    Scalar parameters with a default are in `Bindings.scalars`; bind the rest (and every tensor
    parameter, in `Bindings.tensors`) before running. Raises `AttnSyntaxError` with
    `file:line:column`, the line and a caret.

    Example:
        >>> ir, bind = parse_attn("score_mod = 30.0 * tanh(score / 30.0)")
        >>> print(ir.expr("score_mod"))
        <30.0 * tanh(score / 30.0) : f32>
        >>> try:
        ...     parse_attn("mask_mod = q_idx >= kv_idx &\\n", "m.attn")
        ... except Exception as e:
        ...     print(e)
        m.attn:1:29: error: unexpected end of line; expected an expression
         1 | mask_mod = q_idx >= kv_idx &
           |                             ^
    """
    src = _Source(text, filename)
    # The grammar ends every statement with a newline; accept files without a final one.
    body = text if text.endswith("\n") else text + "\n"
    try:
        tree = _parser().parse(body)
    except UnexpectedInput as e:
        raise _syntax_error(src, body, e) from None
    _check_depth(src, tree)
    return _Lowerer(src).run(tree)


def load_attn(path: str | os.PathLike[str]) -> tuple[VariantIR, Bindings]:
    """Read and parse a `.attn` file (see `parse_attn`).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "causal.attn")
        >>> _ = open(path, "w").write("mask_mod = q_idx >= kv_idx\\n")
        >>> ir, _ = load_attn(path)
        >>> ir.name, ir.hooks["mask_mod"].source.line
        ('causal', 1)
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return parse_attn(text, filename=path)
