"""Hook analyses: what each hook reads, identity detection, mask/score dependence on b and h
(after simplification), and the static check of head-vector indices in transforms."""
from __future__ import annotations

import pytest
import torch

from attncc.errors import TraceError
from attncc.frontend import Variant
from attncc.ir.analysis import VariantInfo, analyze, check_vector_indices, reads
from attncc.ir.nodes import I32, binary, const, load, var, vec
from attncc.ir.program import HOOK_ORDER, Hook, VariantIR

D = 64


def test_reads_lists_index_variables_including_load_indices() -> None:
    doc = load("doc_ids", (var("b"), var("q_idx")), I32)
    assert reads(binary("eq", doc, var("kv_idx"))) == {"b", "q_idx", "kv_idx"}
    assert reads(var("score") * 2) == {"score"}
    assert reads(const(True)) == frozenset()
    assert reads(vec("q", binary("mod", var("d") + 1, const(D)))) == {"d"}


def test_causal_mask_does_not_depend_on_batch_or_head() -> None:
    info = analyze(Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).trace()[0])
    assert isinstance(info, VariantInfo)
    assert not info.mask_depends_on_bh
    assert not info.mask_depends_on_b and not info.mask_depends_on_h
    assert info.reads["mask_mod"] == {"q_idx", "kv_idx"}
    assert not info.identity["mask_mod"] and info.identity["score_mod"]


def test_document_mask_depends_on_batch_only() -> None:
    doc_ids = torch.zeros(2, 16, dtype=torch.int32)

    def doc_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    info = analyze(Variant(mask_mod=doc_mask).trace()[0])
    assert info.mask_depends_on_b and not info.mask_depends_on_h and info.mask_depends_on_bh


def test_head_specific_window_depends_on_head_only() -> None:
    window = torch.tensor([16, 32, 64, 128])

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window[h])

    info = analyze(Variant(mask_mod=sliding).trace()[0])
    assert info.mask_depends_on_h and not info.mask_depends_on_b and info.mask_depends_on_bh


def test_dependence_is_judged_after_simplification() -> None:
    def fake_head_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((h * 0 + b - b) == 0)

    def fake_head_score(score, b, h, q_idx, kv_idx):
        return score + (h - h) * 3

    info = analyze(Variant(score_mod=fake_head_score, mask_mod=fake_head_mask).trace()[0])
    assert not info.mask_depends_on_bh and not info.score_depends_on_bh
    assert info.identity["score_mod"]  # score + 0 is the identity


def test_alibi_score_depends_on_head_and_no_mask_means_no_dependence() -> None:
    slopes = torch.rand(8)
    info = analyze(Variant(score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv)).trace()[0])
    assert info.score_depends_on_bh
    assert info.reads["score_mod"] == {"score", "h", "q_idx", "kv_idx"}
    assert info.identity["mask_mod"] and not info.mask_depends_on_bh


def test_identity_reported_for_all_six_hooks() -> None:
    ir, _ = Variant(query_mod=lambda q, b, h, qi, d: q[d],
                    key_mod=lambda k, b, h, kv, d: k[d] * 2.0,
                    mask_mod=lambda b, h, qi, kv: (qi >= kv) | True).trace()
    info = analyze(ir)
    assert set(info.identity) == set(HOOK_ORDER) == set(info.reads)
    assert info.identity == {"query_mod": True, "key_mod": False, "value_mod": True,
                             "score_mod": True, "mask_mod": True, "output_mod": True}
    assert info.reads["key_mod"] == {"d"} and info.reads["mask_mod"] == frozenset()


# ----------------------------------------------------------------------------- vector indices


def rope(q, b, h, q_idx, d):
    half = D // 2
    rot = torch.where(d < half, -q[(d + half) % D], q[(d - half) % D])
    angle = q_idx * (10000.0 ** (-(d % half).float() * 2 / D))
    return q[d] * torch.cos(angle) + rot * torch.sin(angle)


def shifted(q, b, h, q_idx, d):
    return q[d] + q[d + 1]


def test_rope_with_wrapped_indices_passes() -> None:
    ir, bind = Variant(query_mod=rope, key_mod=rope).trace()
    check_vector_indices(ir, D, params=bind.scalars)
    check_vector_indices(ir, D)  # D unknown: the indices are not checkable, so nothing to flag


def test_out_of_range_index_names_the_hook_source_and_the_fix() -> None:
    ir, _ = Variant(query_mod=shifted).trace()
    with pytest.raises(TraceError) as err:
        check_vector_indices(ir, D)
    msg = str(err.value)
    assert "test_analysis.py" in msg and "shifted" in msg and "query_mod" in msg
    assert "q[d + 1]" in msg and "index 64 (for d = 63)" in msg and "[0, 64)" in msg
    assert "% D" in msg and "q[(d + D // 2) % D]" in msg


def test_negative_index_range_is_reported() -> None:
    e = vec("k", var("d") - 2)
    ir = VariantIR(hooks={"key_mod": Hook("key_mod", e)})
    with pytest.raises(TraceError, match=r"indices -2\.\.-1 \(for d in 0\.\.1\)"):
        check_vector_indices(ir, 8)


def test_rope_with_wrong_head_dim_param_fails() -> None:
    ir, bind = Variant(query_mod=rope).trace()
    with pytest.raises(TraceError, match="outside the head vector"):
        check_vector_indices(ir, 32, params=bind.scalars)  # D=64 indices into a 32-wide head


def test_indices_reading_positions_or_tensors_are_skipped() -> None:
    perm = torch.arange(D)
    ir, _ = Variant(query_mod=lambda q, b, h, qi, d: q[(d + qi) % 1000],
                    key_mod=lambda k, b, h, kv, d: k[perm[d]]).trace()
    check_vector_indices(ir, D)


def test_value_head_dim_applies_to_value_and_output_mods() -> None:
    ir, _ = Variant(value_mod=lambda v, b, h, kv, d: v[(d + 4) % 128]).trace()
    check_vector_indices(ir, 64, v_head_dim=128)
    with pytest.raises(TraceError, match="value_mod"):
        check_vector_indices(ir, 128, v_head_dim=64)


def test_unevaluable_index_is_a_trace_error() -> None:
    e = vec("q", binary("floordiv", var("d"), const(0)))
    with pytest.raises(TraceError, match="cannot be computed"):
        check_vector_indices(VariantIR(hooks={"query_mod": Hook("query_mod", e)}), 8)
