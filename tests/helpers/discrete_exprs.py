"""Random mods whose float arithmetic becomes integers, for the discrete-semantics tests.

Each case is Python source for the body of `score_mod(score, b, h, q_idx, kv_idx)` returning an
integer tensor (an int cast, a floor, a comparison, a `where`), plus the captured Python floats
it reads. Constants are chosen to put values near integer and threshold boundaries (the T5
bucket's log(max_distance / max_exact), 0.1, 1/3, ...), where one ulp of a different rounding
changes the result. Values stay inside int32 and away from NaN / inf (whose casts torch leaves
undefined). `tests/codegen/test_discrete_semantics.py` runs them on the CPU, `tests/gpu/
test_discrete_gpu.py` on CUDA, each against torch float32 on the same device.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

import torch

DIVISORS = (2.7725887, math.log(128 / 8), math.log(100 / 4), 0.1, 0.3, 1 / 3, 3.0, 7.0, 1.5, 0.7,
            10.0, 2.0794415, 6.0, 0.2)
FACTORS = (8.0, 16.0, 3.0, 10.0, 0.1, 7.0, 12.0, 2.5, 0.3, 1.1, 24.0)
THRESHOLDS = (0.5, 1.0, 2.0, 3.3, 7.7, 10.0, 0.1)
# integer tensors of the grid: differences, sums, scaled positions
DISTANCES = ("(q_idx - kv_idx)", "(kv_idx - q_idx)", "q_idx", "(q_idx + kv_idx)",
             "(q_idx * 3 - kv_idx)")
ABS_DISTANCES = ("torch.abs(q_idx - kv_idx)", "kv_idx", "(q_idx + kv_idx)", "torch.abs(kv_idx - 2 * q_idx)")


@dataclass(frozen=True)
class Case:
    source: str  # the body's expression
    captures: dict[str, float]  # captured Python floats it reads (traced as kernel params)

    def function(self) -> Callable:
        """`score_mod` with the captures as closure cells (what attncc turns into params)."""
        names = ", ".join(self.captures) or "_unused=None"
        code = (f"def make({names}):\n"
                f"    def mod(score, b, h, q_idx, kv_idx):\n"
                f"        return {self.source}\n"
                f"    return mod\n")
        namespace = {"torch": torch, "math": math}
        exec(compile(code, f"<discrete case {self.source[:40]}>", "exec"), namespace)
        return namespace["make"](**self.captures)


class _Builder:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.captures: dict[str, float] = {}

    def num(self, pool: tuple[float, ...]) -> str:
        """A constant: a literal in the source, or (half the time) a captured Python float."""
        v = self.rng.choice(pool)
        if self.rng.random() < 0.5:
            name = f"c{len(self.captures)}"
            self.captures[name] = v
            return name
        return repr(v)

    def fl(self, d: str) -> str:
        return f"{d}.float()" if self.rng.random() < 0.7 else f"({d} * 1.0)"

    def case(self) -> str:
        r = self.rng
        d, a = r.choice(DISTANCES), r.choice(ABS_DISTANCES)
        kind = r.randrange(16)
        div, fac, thr = (lambda: self.num(DIVISORS)), (lambda: self.num(FACTORS)), \
            (lambda: self.num(THRESHOLDS))
        if kind == 0:
            return f"({self.fl(d)} / {div()} * {fac()}).long()"
        if kind == 1:
            return f"torch.floor(torch.log(({a} + 1).float() / {div()}) / {div()} * {fac()}).long()"
        if kind == 2:
            return self.t5()
        if kind == 3:
            return f"torch.where({self.fl(d)} * {fac()} > {thr()}, {d}, -{a})"
        if kind == 4:
            return f"(torch.exp(-{self.fl(a)} / {div()}) * {fac()}).long()"
        if kind == 5:
            return f"(({self.fl(d)} * {fac()} + {thr()}) // {div()}).long()"
        if kind == 6:
            return f"(torch.remainder({self.fl(d)} * {fac()}, {div()}) < {thr()}).long()"
        if kind == 7:
            return f"(torch.sqrt({self.fl(a)}) * {fac()}).int()"
        if kind == 8:
            e = r.choice([0.5, 2.0, 1.5, 3.0])
            return f"({self.fl(a)} ** {e} / {div()}).long() % 100000"
        if kind == 9:
            return f"(torch.sigmoid(({self.fl(d)} - {thr()}) / {div()}) * {fac()}).long()"
        if kind == 10:
            return f"(torch.tanh({self.fl(d)} / {div()}) * {fac()}).long()"
        if kind == 11:
            return f"(torch.log2({self.fl(a)} + {thr()}) * {fac()}).long()"
        if kind == 12:
            return f"torch.exp2({self.fl(a)} / {r.choice([8.0, 12.0, 16.0])}).long()"
        if kind == 13:
            return f"((({self.fl(d)} / {div()}).floor() * {fac()}) < {thr()}).long()"
        if kind == 14:
            return f"torch.clamp(({self.fl(d)} / {div()} * {fac()}).long(), -40, 40)"
        return f"(torch.log({self.fl(a)} + 1.0) / {div()} * {fac()} + {thr()}).int()"

    def t5(self) -> str:
        """Hugging Face T5's relative-position bucket (torch.clamp for the torch.min form)."""
        r = self.rng
        nb = r.choice([16, 32, 64])
        bidirectional = r.random() < 0.5
        maxd = r.choice([64, 100, 128])
        half = nb // 2 if bidirectional else nb
        exact = half // 2
        rel = "(kv_idx - q_idx)"
        ret = f"(({rel} > 0).long() * {half})" if bidirectional else "0"
        n = f"torch.abs({rel})" if bidirectional else f"(-torch.clamp({rel}, max=0))"
        scale = self.num((math.log(maxd / exact),)) if r.random() < 0.5 else \
            f"math.log({maxd} / {exact})"
        large = (f"({exact} + (torch.log({n}.float() / {exact}) / {scale} * ({half} - {exact}))"
                 f".to(torch.long))")
        return (f"{ret} + torch.where({n} < {exact}, {n}, "
                f"torch.clamp({large}, max={half - 1}))")


def cases(count: int, seed: int = 0) -> list[Case]:
    """`count` random cases, the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        b = _Builder(rng)
        out.append(Case(b.case(), dict(b.captures)))
    return out


def sweep_cases() -> list[Case]:
    """The issue's sweep: `score + (|q_idx - kv_idx|.float() / c1 * c2).long()`, 48 formulas."""
    c1s = (2.7725887, 0.1, 0.3, 1 / 3, 3.0, 7.0, 0.7, 2.0794415)
    c2s = (8.0, 16.0, 3.0, 10.0, 0.1, 7.0)
    return [Case(f"score + (torch.abs(q_idx - kv_idx).float() / {c1!r} * {c2!r}).long()", {})
            for c1 in c1s for c2 in c2s]


def torch_grid(q_len: int, kv_len: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """FlexAttention's arguments as torch passes them: int32 indices, a float32 zero score."""
    return {"score": torch.zeros((), device=device),
            "b": torch.zeros((), dtype=torch.int32, device=device),
            "h": torch.zeros((), dtype=torch.int32, device=device),
            "q_idx": torch.arange(q_len, dtype=torch.int32, device=device)[:, None],
            "kv_idx": torch.arange(kv_len, dtype=torch.int32, device=device)[None, :]}


def run_torch(case: Case, grid: dict[str, torch.Tensor]) -> torch.Tensor:
    """The case's Python run by torch on the grid: float64 of its (integer) values."""
    fn = case.function()
    out = fn(grid["score"], grid["b"], grid["h"], grid["q_idx"], grid["kv_idx"])
    shape = (grid["q_idx"].shape[0], grid["kv_idx"].shape[1])
    return torch.as_tensor(out).double().expand(shape)


def t5_bucket(num_buckets: int, max_distance: int
              ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Hugging Face T5's relative-position bucket (bidirectional), with `torch.clamp` in place of
    `torch.min(x, torch.full_like(...))`: the formula whose float32 log bucket issue 27 found."""

    def bucket(q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        rel = kv_idx - q_idx
        half = num_buckets // 2
        ret = (rel > 0).long() * half
        n = torch.abs(rel)
        exact = half // 2
        large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact)
                         * (half - exact)).to(torch.long)
        return ret + torch.where(n < exact, n, torch.clamp(large, max=half - 1))

    return bucket
