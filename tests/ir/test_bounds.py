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
from tests import helpers

ROOT = str(helpers.ROOT)
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


# ----------------------------------------------------------------------------- finding 4, CPU

S = 12


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _qkv(S: int = S, H: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(27)
    return tuple(torch.randn(1, H, S, 16, generator=g, dtype=torch.float64) for _ in range(3))


def _biased_causal(q, k, v, bias_of) -> torch.Tensor:
    """Exact causal attention with score + bias_of(q_idx - kv_idx) at kept positions only."""
    Sq, Skv = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    qi, ki = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    keep = qi >= ki
    rel = (qi - ki).clamp(min=0)
    s = torch.where(keep, s + bias_of(rel), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_table_indexed_by_distance_under_causal_mask_runs_on_cpu_like_torch() -> None:
    table = torch.linspace(-1, 1, S, dtype=torch.float64)  # only distances 0..S-1 exist

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx]

    q, k, v = _qkv()
    out = attncc.flex_attention(q, k, v, score_mod=attncc.Variant(score_mod=rel_bias,
                                                                  mask_mod=causal))
    torch.testing.assert_close(out, _biased_causal(q, k, v, lambda r: table[r]))
    bm = attncc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=4)
    out_bm = attncc.flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm)
    torch.testing.assert_close(out_bm, out)


def test_table_read_outside_at_a_kept_position_is_an_error_naming_line_and_position() -> None:
    table = torch.zeros(S)

    def rel_bias_unmasked(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx]

    q, k, v = _qkv()
    with pytest.raises(attncc.ir.analysis.CapturedReadError) as err:
        attncc.flex_attention(q, k, v, score_mod=rel_bias_unmasked)
    msg = str(err.value)
    assert "test_bounds.py" in msg and "rel_bias_unmasked" in msg and "score_mod" in msg
    assert "table[q_idx - kv_idx] = table[-1] at (b=0, h=0, q_idx=0, kv_idx=1)" in msg
    assert "[0, 12)" in msg and "mask that position" in msg
    assert isinstance(err.value, IndexError)  # what torch raises for the same read


def test_guarded_reads_count_only_where_their_guard_holds() -> None:
    table = torch.linspace(0, 1, S, dtype=torch.float64)

    def guarded(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx >= kv_idx, table[q_idx - kv_idx], 0.0)

    q, k, v = _qkv()
    out = attncc.flex_attention(q, k, v, score_mod=guarded)
    s = q @ k.transpose(-1, -2) / 4
    rel = torch.arange(S)[:, None] - torch.arange(S)[None, :]
    s = s + torch.where(rel >= 0, table[rel.clamp(min=0)], 0.0)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_mask_mod_reads_count_everywhere_unless_short_circuited() -> None:
    short = torch.ones(S - 4, dtype=torch.int32)
    q, k, v = _qkv()

    def reads_past(b, h, q_idx, kv_idx):
        return short[kv_idx] > 0

    with pytest.raises(attncc.ir.analysis.CapturedReadError, match=r"mask_mod reads short\[kv_idx\]"):
        attncc.flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=reads_past))

    def short_circuit(b, h, q_idx, kv_idx):
        return (kv_idx < S - 4) & (short[kv_idx] > 0)

    out = attncc.flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=short_circuit))
    s = (q @ k.transpose(-1, -2) / 4)[..., : S - 4]
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v[:, :, : S - 4])


def test_transform_read_past_its_tensor_is_an_error() -> None:
    scale = torch.ones(S - 1)

    def scaled_q(q, b, h, q_idx, d):
        return q[d] * scale[q_idx]

    q, k, v = _qkv()
    with pytest.raises(attncc.ir.analysis.CapturedReadError,
                       match=r"query_mod reads scale\[q_idx\] = scale\[11\] at \(b=0, h=0, "
                             r"q_idx=11, d=0\)"):
        attncc.flex_attention(q, k, v, score_mod=attncc.Variant(query_mod=scaled_q))


# ----------------------------------------------------------------------------- finding 4, GPU plan


@pytest.mark.parametrize("S", [64, 1000, 4096])
def test_gym_variants_run_unclamped_kernels(S: int) -> None:
    """Every AttentionGym read is proven inside its tensor: the GPU path keeps the IR (so the
    kernel source) exactly as before."""
    from attncc.ir.analysis import Shapes
    from attncc.runtime.flex.api import _as_variant, _trace
    from attncc.runtime.flex.gpu_flex import _clamped
    from attncc.gym import GYM

    B, H, D = 2, 8, 128
    for name, make in GYM.items():
        ir, bind = _trace(_as_variant(make(B, H, S, D)))
        got, sizes = _clamped(ir, Shapes(B, H, H, S, S, D, D), bind.tensors, bind.scalars)
        assert got is ir and not sizes, name


def test_clamped_gpu_ir_reads_only_inside_and_matches_the_reference() -> None:
    """What the GPU path runs for `table[q_idx - kv_idx]` under causal: every read clamped into
    the table (evaluated without `oob`, an out-of-range read would raise), same result."""
    from attncc.ir.analysis import Shapes
    from attncc.runtime.flex.api import _trace
    from attncc.runtime.flex.gpu_flex import _clamped
    from attncc.runtime.reference import attention_reference
    from attncc.ir.program import Bindings

    table = torch.linspace(-1, 1, S, dtype=torch.float64)
    var = attncc.Variant(score_mod=lambda s, b, h, qi, ki: s + table[qi - ki], mask_mod=causal)
    ir, bind = _trace(var)
    got, sizes = _clamped(ir, Shapes(1, 2, 2, S, S, 16, 16), bind.tensors, bind.scalars)
    assert got is not ir and sizes == {"table_size0": S}
    assert "max(min(q_idx - kv_idx, table_size0 - 1), 0)" in got.format()
    from attncc.ir.evaluator import evaluate
    env = {"score": torch.zeros(()), "b": torch.tensor(0), "h": torch.tensor(0),
           "q_idx": torch.arange(S)[:, None], "kv_idx": torch.arange(S)[None, :]}
    evaluate(got.expr("score_mod"), env, bind.tensors, sizes)  # raises on an outside read
    q, k, v = _qkv()
    out, _ = attention_reference(q, k, v, got, Bindings({**bind.scalars, **sizes},
                                                        bind.tensors))
    torch.testing.assert_close(out, _biased_causal(q, k, v, lambda r: table[r]))


def test_gpu_plan_rejects_a_read_outside_at_a_kept_position_before_compiling() -> None:
    from attncc.ir.analysis import CapturedReadError, Shapes
    from attncc.runtime.flex.api import _trace
    from attncc.runtime.flex.gpu_flex import _clamped

    table = torch.zeros(S)

    def short_table(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    ir, bind = _trace(attncc.Variant(score_mod=short_table, mask_mod=causal))
    with pytest.raises(CapturedReadError, match=r"short_table.*table\[kv_idx\] = table\[12\] at "
                                                r"\(b=0, h=0, q_idx=12, kv_idx=12\)"):
        _clamped(ir, Shapes(1, 2, 2, S + 1, S + 1, 16, 16), bind.tensors, bind.scalars)


# ----------------------------------------------------------------------------- finding 5


def test_index_expression_past_32_bits_at_the_call_shapes_warns_naming_it() -> None:
    import warnings

    from attncc.ir.analysis import IndexOverflowWarning

    table = torch.zeros(4)

    def hashed_bucket(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx * 65536 + kv_idx) % 4]

    var = attncc.Variant(score_mod=hashed_bucket)
    kv = torch.randn(1, 1, 2, 8)
    with pytest.warns(IndexOverflowWarning) as rec:  # 65536 * 40000 > 2**31
        attncc.flex_attention(torch.randn(1, 1, 40000, 8), kv, kv, score_mod=var)
    msg = str(rec[0].message)
    assert "hashed_bucket" in msg and "65536 * q_idx" in msg and "32-bit" in msg
    assert "q_idx < 40000" in msg and "2621374464" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error", IndexOverflowWarning)
        attncc.flex_attention(torch.randn(1, 1, 30000, 8), kv, kv, score_mod=var)  # fits


# ----------------------------------------------------------------------------- checked mode


def _indirect(S: int, bad_row: int | None):
    """tbl[pos[q_idx] - kv_idx] under causal: pos is the identity (every kept read inside) or
    sends `bad_row` past the table -- reads the interval analysis can neither prove nor refute
    at the domain's corners."""
    pos = torch.arange(S)
    if bad_row is not None:
        pos[bad_row] += S
    tbl = torch.linspace(0, 1, S, dtype=torch.float64)

    def indirect_bias(score, b, h, q_idx, kv_idx):
        return score + tbl[pos[q_idx] - kv_idx]

    return attncc.Variant(score_mod=indirect_bias, mask_mod=causal)


def test_undecided_reads_are_clamped_and_the_checked_mode_finds_kept_violations() -> None:
    from attncc.ir.analysis import CapturedReadError, Shapes
    from attncc.runtime.flex.api import _trace
    from attncc.runtime.flex.gpu_flex import _check_reads_exactly, _clamped

    q, k, v = _qkv()
    shapes = Shapes(1, 2, 2, S, S, 16, 16)
    for bad_row in (None, 5):
        ir, bind = _trace(_indirect(S, bad_row))
        got, sizes = _clamped(ir, shapes, bind.tensors, bind.scalars)
        assert sizes == {"tbl_size0": S}  # undecided: clamped, not an error
    _check_reads_exactly(q, k, v, *_indirect(S, None).trace(), None, None, False)
    with pytest.raises(CapturedReadError, match=r"indirect_bias.*tbl\[pos\[q_idx\] - kv_idx\] = "
                                                r"tbl\[17\] at \(b=0, h=0, q_idx=5, kv_idx=0\)"):
        _check_reads_exactly(q, k, v, *_indirect(S, 5).trace(), None, None, False)


# ----------------------------------------------------------------------------- serving


def _planned(variant, q_positions=None):
    from attncc.runtime.serving.batch import BatchAttention

    ba = BatchAttention(variant, kv_layout="NHD", device="cpu")
    ba.plan(torch.tensor([0, 1, 3]), torch.tensor([0, 2, 3]), torch.tensor([4, 0, 2]),
            torch.tensor([16, 5]), num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
            q_positions=q_positions)
    return ba  # KV lengths 32 and 5


def test_serving_clamps_reads_the_plan_does_not_prove_and_passes_their_sizes() -> None:
    slopes, dist = torch.ones(8), torch.zeros(32)
    alibi = attncc.Variant(score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv),
                           mask_mod=causal)
    ba = _planned(alibi)
    ir, bind = alibi.trace()
    assert ba._safe_reads(ir, bind) == (ir, bind)  # proven inside: the kernel is unchanged
    rel = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + dist[q - kv], mask_mod=causal)
    ba = _planned(rel)
    got, gbind = ba._safe_reads(*rel.trace())
    assert "dist[max(min(q_idx - kv_idx, dist_size0 - 1), 0)]" in got.format()
    assert gbind.scalars == {"dist_size0": 32}
    # a read outside at a kept position of the box is clamped here, not an error (the box may
    # hold positions this step's batch does not)
    short = torch.zeros(8)
    bad = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + short[kv], mask_mod=causal)
    got, gbind = _planned(bad)._safe_reads(*bad.trace())
    assert "short[max(min(kv_idx, short_size0 - 1), 0)]" in got.format()
    # explicit positions: nothing is proven, every read is clamped
    got, gbind = _planned(alibi, q_positions=torch.tensor([7, 1, 2]))._safe_reads(*alibi.trace())
    assert "slopes[max(min(h, slopes_size0 - 1), 0)]" in got.format()


def test_gpu_witness_must_lie_in_a_block_the_block_mask_computes() -> None:
    """A witness in a block the block mask leaves out is no witness: the kernel never evaluates
    the hooks there (and the CPU never counts it)."""
    from attncc.ir.analysis import CapturedReadError, Shapes
    from attncc.runtime.flex.api import _trace
    from attncc.runtime.flex.gpu_flex import _clamped

    table = torch.zeros(S)
    ir, bind = _trace(attncc.Variant(score_mod=lambda s, b, h, qi, ki: s + table[qi - ki]))
    shapes = Shapes(1, 2, 2, S, S, 16, 16)
    with pytest.raises(CapturedReadError, match=r"q_idx=0, kv_idx=11"):
        _clamped(ir, shapes, bind.tensors, bind.scalars)
    bm = attncc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=4)
    got, sizes = _clamped(ir, shapes, bind.tensors, bind.scalars, bm)
    assert sizes == {"table_size0": S}  # undecided without the mask_mod: clamped


def test_flex_rejects_position_dependent_head_vector_read_past_the_head_dim() -> None:
    q, k, v = (torch.randn(1, 1, 8, 64) for _ in range(3))

    def rolled(q, b, h, q_idx, d):
        return q[(d + q_idx) % 80]

    with pytest.raises(TraceError, match=r"test_bounds.py:\d+ \(rolled\): query_mod reads "
                                         r"q\[\(d \+ q_idx\) % 80\] = q\[64\] at \(q_idx=1, "
                                         r"d=63\), outside the head vector \[0, 64\)"):
        attncc.flex_attention(q, k, v, score_mod=attncc.Variant(query_mod=rolled))
    perm = torch.randperm(64)
    ok = attncc.Variant(query_mod=lambda q, b, h, qi, d: q[(d + qi) % 64],
                        key_mod=lambda k, b, h, kv, d: k[perm[d]])
    assert attncc.flex_attention(q, k, v, score_mod=ok).shape == (1, 1, 8, 64)
    bad_perm = perm.clone()
    bad_perm[5] = 64
    bad = attncc.Variant(key_mod=lambda k, b, h, kv, d: k[bad_perm[d]])
    with pytest.raises(TraceError, match=r"key_mod reads k\[bad_perm\[d\]\] = k\[64\] at \(d=5\)"):
        attncc.flex_attention(q, k, v, score_mod=bad)
