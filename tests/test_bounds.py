"""Issue 27, findings 3-5: a variant's reads mean what its Python means.

Head-vector reads outside the head dim being compiled are errors at compile / export / call
time; captured-tensor reads are checked against the call's shapes (an out-of-range read at a
position the mask keeps is an error, at a masked position it is harmless, as in torch); index
arithmetic that can overflow 32 bits gets a warning.
"""
from __future__ import annotations

import os

import pytest
import torch

import attncc
from attncc.cli import main
from attncc.errors import TraceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROPE_ATTN = os.path.join(ROOT, "examples", "rope.attn")


def shifted_far(q, b, h, q_idx, d):
    return q[d + 1000]


# ----------------------------------------------------------------------------- finding 3


def test_flex_rejects_head_vector_read_past_the_head_dim_naming_the_line() -> None:
    q, k, v = (torch.randn(1, 1, 4, 64) for _ in range(3))
    with pytest.raises(TraceError) as err:
        attncc.flex_attention(q, k, v, score_mod=attncc.Variant(query_mod=shifted_far))
    msg = str(err.value)
    assert "test_bounds.py" in msg and "shifted_far" in msg and "q[d + 1000]" in msg
    assert "[0, 64)" in msg


def test_flex_checks_value_mods_against_the_value_head_dim() -> None:
    q, k = (torch.randn(1, 1, 4, 64) for _ in range(2))
    v = torch.randn(1, 1, 4, 32)
    var = attncc.Variant(value_mod=lambda v, b, h, kv, d: v[(d + 40) % 64])
    with pytest.raises(TraceError, match=r"value_mod.*\[0, 32\)"):
        attncc.flex_attention(q, k, v, score_mod=var)
    ok = attncc.Variant(value_mod=lambda v, b, h, kv, d: v[(d + 4) % 32])
    assert attncc.flex_attention(q, k, v, score_mod=ok).shape == (1, 1, 4, 32)


def test_compile_and_export_reject_head_vector_read_past_the_head_dim(tmp_path) -> None:
    var = attncc.Variant(query_mod=shifted_far)
    with pytest.raises(TraceError, match=r"q\[d \+ 1000\].*\[0, 128\)"):
        attncc.compile(var, head_dim=128, arch="sm_90a", cache=False)
    with pytest.raises(TraceError, match=r"q\[d \+ 1000\].*\[0, 64\)"):
        attncc.export(var, tmp_path / "x.cu", head_dim=64)
    assert not (tmp_path / "x.cu").exists()


def test_cli_export_of_rope_example_at_a_smaller_head_dim_fails(capsys, tmp_path) -> None:
    target = tmp_path / "rope.cu"
    rc = main(["export", ROPE_ATTN, "-o", str(target), "--head-dim", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and not target.exists()
    assert "rope.attn" in err and "query_mod" in err and "[0, 64)" in err
    rc = main(["compile", ROPE_ATTN, "--emit", "cuda", "--head-dim", "64"])
    assert rc == 2 and "[0, 64)" in capsys.readouterr().err
    assert main(["export", ROPE_ATTN, "-o", str(target), "--head-dim", "128"]) == 0
