"""Property test: random score_mods (≥1,000 per run, fixed seed, bounded time) trace → simplify →
evaluate to what the plain Python function computes on tensors, and their generated CUDA compiles."""
from __future__ import annotations

import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attncc.frontend import Variant
from attncc.ir.evaluator import evaluate
from attncc.ir.simplify import simplify_variant

N_EXAMPLES = 1000
TIME_BUDGET_S = 240.0
B, H, Q, K = 2, 3, 5, 7

# A generated expression is (python_source, kind) with kind in {"f", "i", "b"} (float/int/bool).
_TENSOR_VAR = re.compile(r"\b(score|tab|q_idx|kv_idx|b|h)\b")


def _tensorish(e: str) -> str:
    """torch functions need a tensor argument in the plain-Python check: add one if missing."""
    return e if _TENSOR_VAR.search(e) else f"(score + {e})"


INT_LEAVES = ["b", "h", "q_idx", "kv_idx", "n0", "(q_idx - kv_idx)"]
FLOAT_LEAVES = ["score", "c0", "c1", "tab[h, kv_idx]"]


def _exprs(kind: str, depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        if kind == "i":
            return st.one_of(st.sampled_from(INT_LEAVES), st.integers(-9, 9).map(str))
        if kind == "f":
            return st.one_of(st.sampled_from(FLOAT_LEAVES),
                             st.floats(-4, 4, allow_nan=False).map(lambda x: repr(round(x, 3))))
        return st.sampled_from(["(q_idx >= kv_idx)", "(h == 1)", "(score > 0)", "(kv_idx >= 0)"])
    sub = lambda k: _exprs(k, depth - 1)  # noqa: E731
    if kind == "i":
        return st.one_of(
            sub("i"),
            st.tuples(sub("i"), st.sampled_from(["+", "-", "*"]), sub("i")).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(sub("i"), st.sampled_from(["//", "%"]),
                      st.sampled_from([-7, -3, -2, 2, 3, 5, 8])).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(sub("i"), st.integers(-5, 0), st.integers(1, 5)).map(
                lambda t: f"({_tensorish(t[0])}).clamp({t[1]}, {t[2]})"),
            st.tuples(sub("b"), sub("i"), sub("i")).map(
                lambda t: f"torch.where({t[0]}, {t[1]}, {t[2]})"),
            st.tuples(sub("i"), sub("i")).map(
                lambda t: f"torch.minimum({_tensorish(t[0])}, {_tensorish(t[1])})"),
            st.tuples(sub("i"), sub("i")).map(
                lambda t: f"torch.maximum({_tensorish(t[0])}, {_tensorish(t[1])})"),
            sub("i").map(lambda e: f"(-{e})"),
        )
    if kind == "f":
        unary = st.sampled_from(["torch.tanh", "torch.sigmoid", "torch.sin", "torch.cos",
                                 "torch.abs", "torch.floor"])
        return st.one_of(
            sub("f"),
            sub("i").map(lambda e: f"({e} * 0.5)"),
            st.tuples(sub("f"), st.sampled_from(["+", "-", "*"]), st.one_of(sub("f"), sub("i"))).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(sub("f"), sub("f")).map(
                lambda t: f"({t[0]} / (torch.abs({_tensorish(t[1])}) + 1.0))"),
            st.tuples(unary, sub("f")).map(lambda t: f"{t[0]}({_tensorish(t[1])})"),
            sub("f").map(lambda e: f"torch.sqrt(torch.abs({_tensorish(e)}))"),
            sub("f").map(lambda e: f"torch.exp(torch.clamp({_tensorish(e)}, -8.0, 8.0))"),
            sub("f").map(lambda e: f"torch.log2(torch.abs({_tensorish(e)}) + 0.5)"),
            st.tuples(sub("b"), sub("f"), st.one_of(sub("f"), sub("i"))).map(
                lambda t: f"torch.where({t[0]}, {t[1]}, {t[2]})"),
            st.tuples(sub("f"), sub("f")).map(
                lambda t: f"torch.maximum({_tensorish(t[0])}, {_tensorish(t[1])})"),
            sub("f").map(lambda e: f"(-{e})"),
        )
    return st.one_of(
        sub("b"),
        st.tuples(st.one_of(sub("i"), sub("f")), st.sampled_from(["<", "<=", ">", ">=", "==", "!="]),
                  st.one_of(sub("i"), sub("f"))).map(
                      lambda t: f"({_tensorish(t[0])} {t[1]} {t[2]})"),
        st.tuples(sub("b"), st.sampled_from(["&", "|"]), sub("b")).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        sub("b").map(lambda e: f"(~{e})"),
    )


def _make_mod(src: str, c0: float, c1: float, n0: int, tab: torch.Tensor):
    code = f"def mod(score, b, h, q_idx, kv_idx):\n    return {src}\n"

    def factory(c0, c1, n0, tab):
        namespace = {"torch": torch}
        # closures: exec a wrapper that binds the captures as cells of `mod`
        wrapper = "def make(c0, c1, n0, tab):\n" + "\n".join("    " + ln for ln in code.splitlines()) \
            + "\n    return mod\n"
        exec(compile(wrapper, "<generated-mod>", "exec"), namespace)
        return namespace["make"](c0, c1, n0, tab)

    return factory(c0, c1, n0, tab)


def _env() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"score": torch.randn(B, H, Q, K, generator=g, dtype=torch.float64) * 2,
            "b": torch.arange(B).view(B, 1, 1, 1), "h": torch.arange(H).view(1, H, 1, 1),
            "q_idx": torch.arange(Q).view(1, 1, Q, 1), "kv_idx": torch.arange(K).view(1, 1, 1, K)}


def _run_float32(fn, env: dict[str, torch.Tensor]) -> torch.Tensor:
    """`fn` on a float32 score with float32 as the default dtype, as a float64 tensor."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        out = fn(env["score"].float(), env["b"], env["h"], env["q_idx"], env["kv_idx"])
    finally:
        torch.set_default_dtype(old)
    return torch.as_tensor(out).double()


@pytest.mark.speed
def test_random_score_mods_trace_simplify_evaluate_and_compile() -> None:
    env = _env()
    tab = torch.randn(H, K, dtype=torch.float64)
    collected = []
    start = time.monotonic()
    old_default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # plain-Python int/int division then matches f64 eval

    @settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(src=st.one_of(_exprs("f", 3), _exprs("i", 2).map(lambda e: f"(score + {e})")),
           c0=st.floats(-3, 3, allow_nan=False), c1=st.floats(0.5, 40, allow_nan=False),
           n0=st.integers(-4, 4))
    def check(src: str, c0: float, c1: float, n0: int) -> None:
        if time.monotonic() - start > TIME_BUDGET_S:
            pytest.fail(f"property test exceeded its {TIME_BUDGET_S}s budget after "
                        f"{len(collected)} examples")
        fn = _make_mod(src, c0, c1, n0, tab)
        ir, bind = Variant(score_mod=fn).trace()
        simple = simplify_variant(ir)
        got = evaluate(simple.expr("score_mod"), env, bind.tensors, bind.scalars, torch.float64)
        want = fn(env["score"], env["b"], env["h"], env["q_idx"], env["kv_idx"])
        want = torch.as_tensor(want, dtype=torch.float64).expand(B, H, Q, K)
        got = got.expand(B, H, Q, K)
        scale = 1.0 + float(torch.nan_to_num(want, posinf=0, neginf=0).abs().max())
        close = torch.isclose(got, want, rtol=1e-6, atol=1e-6 * scale, equal_nan=True)
        if not bool(close.all()):
            # A float that becomes discrete (floor, a comparison) is computed in float32, as
            # torch computes it (docs/semantics.md): where float64 lands on the other side of
            # a boundary, the float32 run of the same Python is the oracle.
            want32 = _run_float32(fn, env).expand(B, H, Q, K)
            close |= torch.isclose(got, want32, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)
            torch.testing.assert_close(got[~close], want[~close], rtol=1e-6,
                                       atol=1e-6 * scale, equal_nan=True,
                                       msg=lambda m: f"{src}\n{simple.format()}\n{m}")
        collected.append(simple)

    try:
        check()
    finally:
        torch.set_default_dtype(old_default)
    assert len(collected) >= N_EXAMPLES
    _compile_all(collected)


def _compile_all(variants) -> None:
    """Codegen for every variant, NVRTC on batches (one translation unit per batch)."""
    from attncc.codegen.testing import hook_test_unit

    try:
        from attncc.runtime.jit.nvrtc import available, compile_cuda
    except ImportError:  # pragma: no cover - runtime always ships nvrtc.py
        pytest.skip("attncc.runtime.jit.nvrtc missing")
    units = [hook_test_unit(variants[i:i + 250], prefix=f"p{i}") for i in range(0, len(variants), 250)]
    assert all(units)
    if not available():
        pytest.skip("NVRTC is not available: codegen ran, compile skipped")
    for src in units:
        compile_cuda(src, arch="sm_80")
