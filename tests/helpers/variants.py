"""Variants the FA3 tests add to the AttentionGym set: `VARIANTS` is `GYM` plus `value_output`
(value and output transforms reading other elements of the vector)."""
from __future__ import annotations

import attncc
from attncc.gym import GYM


def value_output(B: int, H: int, S: int, D: int, seed: int = 0) -> attncc.Variant:
    """value_mod and output_mod reading other elements of the vector, plus a score_mod."""
    return attncc.Variant(value_mod=lambda v, b, h, kv, d: v[d] - 0.5 * v[(d + 1) % D],
                          output_mod=lambda o, b, h, q, d: 2.0 * o[d] + o[D - 1 - d],
                          score_mod=lambda s, b, h, q, kv: s * 1.5, name="value_output")


VARIANTS = {**GYM, "value_output": value_output}
