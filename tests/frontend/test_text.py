"""The `.attn` text frontend: the Python frontend's IR, and errors with line:column + caret."""
from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from attncc import Variant, or_masks
from attncc.errors import AttnSyntaxError
from attncc.frontend.text import load_attn, parse_attn
from attncc.ir.nodes import F32, I32
from attncc.ir.program import ScalarParam, TensorParam
from tests import helpers

ROOT = str(helpers.ROOT)


def same_hooks(text_ir, py_ir) -> None:
    """Every hook of both variants is the very same interned node."""
    assert set(text_ir.hooks) == set(py_ir.hooks)
    for h in text_ir.hooks:
        assert text_ir.expr(h) is py_ir.expr(h), (h, text_ir.expr(h), py_ir.expr(h))


def error_of(text: str, filename: str = "t.attn") -> str:
    with pytest.raises(AttnSyntaxError) as info:
        parse_attn(text, filename)
    return str(info.value)


def caret_at(msg: str) -> tuple[int, int]:
    """(line, column) the first snippet's caret points at, read off the rendered message."""
    lines = msg.splitlines()
    for i, ln in enumerate(lines):
        if "^" in ln and "|" in ln and i > 0:
            src_line = lines[i - 1]
            lineno = int(src_line.split("|")[0])
            start = ln.index("|") + 2  # the gutter is " N | "
            return lineno, ln.index("^") - start + 1
    raise AssertionError(f"no caret in:\n{msg}")


# ----------------------------------------------------------------------------- round trips


def test_causal_matches_python():
    ir, bind = parse_attn("mask_mod = q_idx >= kv_idx")
    py, _ = Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).trace()
    same_hooks(ir, py)
    assert ir.normalize == "softmax" and bind.scalars == {} and bind.tensors == {}


def test_sliding_window_with_scalar_param_matches_python():
    window = 256

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    py, pyb = Variant(mask_mod=sliding).trace()
    ir, bind = parse_attn("variant sliding(window: i32 = 256)\n"
                          "mask_mod = (q_idx >= kv_idx) & (q_idx - kv_idx < window)\n")
    same_hooks(ir, py)
    assert ir.scalars == py.scalars == (ScalarParam("window", I32),)
    assert bind.scalars == pyb.scalars == {"window": 256}
    assert ir.name == "sliding"


def test_softcap_param_and_literal_forms_match_python():
    cap = 30.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    py, pyb = Variant(score_mod=softcap).trace()
    ir, bind = parse_attn("variant softcap(cap: f32 = 30)\nscore_mod = cap * tanh(score / cap)")
    same_hooks(ir, py)
    assert ir.scalars == (ScalarParam("cap", F32),) and bind.scalars == pyb.scalars
    assert isinstance(bind.scalars["cap"], float)
    # literals: 30 is an int constant promoted exactly as in Python
    lit, _ = parse_attn("score_mod = 30 * tanh(score / 30)")
    py_lit, _ = Variant(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30)).trace()
    same_hooks(lit, py_lit)


def test_alibi_with_tensor_param_matches_python_and_is_unbound():
    slopes = torch.rand(8)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    py, pyb = Variant(score_mod=alibi).trace()
    ir, bind = parse_attn("variant alibi(slopes: tensor f32[H])\n"
                          "score_mod = score - slopes[h] * (q_idx - kv_idx)\n")
    same_hooks(ir, py)
    assert ir.tensors == py.tensors == (TensorParam("slopes", "float32", 1, F32),)
    assert bind.tensors == {} and set(pyb.tensors) == {"slopes"}


def test_prefix_lm_with_scalar_matches_python():
    prefix_len = 128

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_len

    py, _ = Variant(mask_mod=or_masks(prefix, lambda b, h, q, kv: q >= kv)).trace()
    ir, bind = parse_attn("variant prefix_lm(prefix_len: i32)\n"
                          "mask_mod = (kv_idx < prefix_len) | (q_idx >= kv_idx)\n")
    same_hooks(ir, py)
    assert bind.scalars == {}  # no default: bound later


def test_rope_query_mod_matches_python():
    def rope(q, b, h, q_idx, d):
        return q[d] * torch.cos(q_idx.float()) - q[(d + 32) % 64] * torch.sin(q_idx.float())

    py, _ = Variant(query_mod=rope).trace()
    ir, _ = parse_attn("query_mod = q[d] * cos(f32(q_idx)) - q[(d + 32) % 64] * sin(f32(q_idx))")
    same_hooks(ir, py)
    # cos() of an integer casts it, exactly as torch.cos does on the Python side
    implicit, _ = parse_attn("query_mod = q[d] * cos(q_idx) - q[(d + 32) % 64] * sin(q_idx)")
    same_hooks(implicit, py)


def test_constant_expressions_fold_like_python():
    ir, _ = parse_attn("score_mod = where(q_idx >= kv_idx, score * (1 / 8), -inf) + 2 ** 3")
    py, _ = Variant(score_mod=lambda s, b, h, q, kv:
                    torch.where(q >= kv, s * (1 / 8), -float("inf")) + 2 ** 3).trace()
    same_hooks(ir, py)
    ir2, _ = parse_attn("score_mod = score + 7 // 2 + -7 % 3 + sqrt(16.0) + -2147483648")
    py2, _ = Variant(score_mod=lambda s, b, h, q, kv:
                     s + 7 // 2 + -7 % 3 + math.sqrt(16.0) + -2147483648).trace()
    same_hooks(ir2, py2)


def test_other_hooks_and_operators_match_python():
    text = """
variant all_hooks(scale: f32 = 0.5, shift: i32 = 3, bias: tensor bf16[H, S, S], tbl: tensor i32[S])
key_mod = k[d] * scale
value_mod = abs(v[(d + shift) % 64])
output_mod = clamp(o[d], -1.0, 1.0) + sigmoid(exp2(f32(h)))
score_mod = (max(score, min(log(score), 1.5)) + bias[b, q_idx, kv_idx]
             + pow(score, 2) - floor(score) ** 0.5)
mask_mod = ~(tbl[q_idx] != tbl[kv_idx]) ^ (h == 0) | (kv_idx // 2 <=
                                                      i32(rsqrt(f32(q_idx + 1)) * 4.0))
"""
    ir, bind = parse_attn(text)
    scale, shift = 0.5, 3
    bias = torch.zeros(8, 16, 16, dtype=torch.bfloat16)
    tbl = torch.zeros(16, dtype=torch.int32)
    py, _ = Variant(
        key_mod=lambda k, b, h, kv_idx, d: k[d] * scale,
        value_mod=lambda v, b, h, kv_idx, d: torch.abs(v[(d + shift) % 64]),
        output_mod=lambda o, b, h, q_idx, d: torch.clamp(o[d], -1.0, 1.0) +
        torch.sigmoid(torch.exp2(h.float())),
        score_mod=lambda score, b, h, q_idx, kv_idx: torch.maximum(
            score, torch.clamp(torch.log(score), max=1.5)) +
        bias[b, q_idx, kv_idx] + torch.pow(score, 2) - torch.floor(score) ** 0.5,
        mask_mod=lambda b, h, q_idx, kv_idx: ~(tbl[q_idx] != tbl[kv_idx]) ^ (h == 0) |
        (kv_idx // 2 <= (torch.rsqrt((q_idx + 1).float()) * 4.0).int()),
    ).trace()
    # Python's `^` binds tighter than `|` just as in the text grammar: same tree
    same_hooks(ir, py)
    assert [t.name for t in ir.tensors] == ["bias", "tbl"]
    assert ir.tensors[0] == TensorParam("bias", "bfloat16", 3, F32)
    assert ir.tensors[1] == TensorParam("tbl", "int32", 1, I32)
    assert bind.scalars == {"scale": 0.5, "shift": 3}


# ----------------------------------------------------------------------------- the language


def test_lets_comments_and_wrapped_lines():
    text = """# sliding-window softcap attention
variant sw(cap: f32 = 30.0,   # the softcap
           window: i32 = 256)

normalize softmax
let rel = q_idx - kv_idx      # reused by two hooks
let near = rel < window
score_mod = cap * tanh(score / cap) - f32(rel) \\
            * 0.0
mask_mod = (rel >= 0) &
           near"""
    with pytest.raises(AttnSyntaxError):  # a newline outside brackets ends the statement
        parse_attn(text)
    fixed = text.replace("(rel >= 0) &\n           near", "((rel >= 0) &\n           near)")
    ir, bind = parse_attn(fixed)
    rel = ir.expr("mask_mod").args[0].args[0]
    assert rel.op == "sub" and ir.expr("mask_mod").args[1].args[0] is rel
    assert bind.scalars == {"cap": 30.0, "window": 256}
    assert ir.hooks["mask_mod"].source.line == 10


def test_normalize_none_and_unused_params_are_dropped():
    ir, bind = parse_attn("variant sig(unused: f32 = 1.0, bias: f32 = -2.0)\nnormalize none\n"
                          "score_mod = sigmoid(score + bias)")
    assert ir.normalize == "none" and not ir.use_softmax
    assert ir.scalars == (ScalarParam("bias", F32),) and bind.scalars == {"bias": -2.0}


def test_name_defaults_to_file_stem(tmp_path):
    p = tmp_path / "my_mask.attn"
    p.write_text("mask_mod = true\n")
    ir, _ = load_attn(p)
    assert ir.name == "my_mask" and ir.expr("mask_mod").attr is True
    assert ir.hooks["mask_mod"].source.file.endswith("my_mask.attn")


def test_zero_rank_tensor_reads_without_index():
    ir, _ = parse_attn("variant z(temp: tensor f32[])\nscore_mod = score / temp")
    assert ir.tensors == (TensorParam("temp", "float32", 0, F32),)
    assert ir.expr("score_mod").args[1].op == "load"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*.attn"))))
def test_examples_parse(path):
    ir, _ = load_attn(path)
    assert ir.hooks


def test_examples_exist():
    assert len(glob.glob(os.path.join(ROOT, "examples", "*.attn"))) >= 3


# ----------------------------------------------------------------------------- parse errors


def test_parse_error_points_at_unexpected_token():
    msg = error_of("variant v\nscore_mod = score +\nmask_mod = q_idx >= kv_idx\n")
    assert msg.startswith("t.attn:2:20: error: unexpected end of line; expected an expression")
    assert caret_at(msg) == (2, 20)
    assert " 2 | score_mod = score +" in msg


def test_parse_error_for_bad_character_and_python_habits():
    msg = error_of("score_mod = score $ 2")
    assert msg.startswith("t.attn:1:19: error: unexpected character '$'")
    assert caret_at(msg) == (1, 19)
    msg = error_of("mask_mod = (q_idx >= kv_idx) and (h < 4)")
    assert caret_at(msg) == (1, 30) and "unexpected name 'and'" in msg and "& | ~" in msg
    msg = error_of("mask_mod = q_idx = kv_idx")
    assert caret_at(msg) == (1, 18) and "'=='" in msg
    msg = error_of("score_mod = torch.tanh(score)")
    assert caret_at(msg) == (1, 18) and "tanh(x)" in msg


def test_parse_error_lists_only_what_fits():
    # no bracket is open, so ')' and ',' must not be suggested
    msg = error_of("score_mod = score score")
    assert "expected an operator" in msg and "')'" not in msg and "','" not in msg
    msg = error_of("variant v(a: f32 b)")
    assert "expected ')', ',' or '='" in msg and caret_at(msg) == (1, 18)
    msg = error_of("score_mod = (score * 2\n\n")
    assert "unexpected end of file" in msg and "not closed" in msg


def test_caret_follows_tabs():
    msg = error_of("\tscore_mod = score +")
    line = [ln for ln in msg.splitlines() if "^" in ln][0]
    assert line.split("| ", 1)[1] == "\t" + " " * 19 + "^"


def test_chained_comparison_is_rejected():
    msg = error_of("mask_mod = 0 <= q_idx < 5")
    assert "cannot be chained" in msg and caret_at(msg) == (1, 23)


# ----------------------------------------------------------------------------- name and type errors


@pytest.mark.parametrize("text, where, words", [
    ("score_mod = d * score", (1, 13), "score_mod cannot read 'd'"),
    ("query_mod = q[kv_idx]", (1, 15), "query_mod cannot read 'kv_idx'"),
    ("mask_mod = score > 0", (1, 12), "mask_mod cannot read 'score'"),
    ("key_mod = q[d]", (1, 11), "the query head vector exists only in query_mod"),
    ("score_mod = scor * 2", (1, 13), "unknown name 'scor'"),
    ("score_mod = tanhh(score)", (1, 13), "unknown function 'tanhh'"),
    ("scor_mod = score", (1, 1), "unknown hook 'scor_mod'"),
    ("score_mod = float(score)", (1, 13), "unknown function 'float'"),
    ("query_mod = q", (1, 13), "read one element"),
    ("score_mod = tanh", (1, 13), "'tanh' is a function"),
    ("score_mod = tanh(score, 1)", (1, 13), "tanh() takes 1 argument, got 2"),
    ("score_mod = score[0]", (1, 13), "'score' cannot be indexed"),
    ("score_mod = 3000000000 * score", (1, 13), "does not fit in 32 bits"),
    ("score_mod = score * (1 / (2 - 2))", (1, 22), "has no value"),
    ("normalize sigmod", (1, 11), "unknown normalization 'sigmod'"),
    ("variant v(h: i32)\nscore_mod = score", (1, 11), "'h' is a built-in name"),
    ("variant v(x: f64)\nscore_mod = score", (1, 14), "unknown parameter type 'f64'"),
    ("variant v(x: tensor f99[H])\nscore_mod = score", (1, 21), "unknown tensor element type"),
    ("variant v(x: f32 = h)\nscore_mod = score", (1, 20), "must be a constant"),
    ("variant v(x: i32 = 0.5)\nscore_mod = score * x", (1, 20),
     "'x' is i32 but its default is a f32"),
    ("variant v(x: f32, x: i32)\nscore_mod = score", (1, 19), "'x' is already defined"),
    ("score_mod = score\nvariant v", (2, 9), "must come first"),
    ("score_mod = score\nscore_mod = 2 * score", (2, 1), "score_mod is given twice"),
    ("let a = 1\nlet a = 2\nscore_mod = score", (2, 5), "'a' is already defined"),
    ("let tanh = 1\nscore_mod = score", (1, 5), "'tanh' is a built-in name"),
    ("let x = 1\nx = 2", (2, 1), "'x' is a let, which cannot be reassigned"),
])
def test_name_errors(text, where, words):
    msg = error_of(text)
    assert words in msg, msg
    assert caret_at(msg) == where, msg
    assert msg.startswith(f"t.attn:{where[0]}:{where[1]}: error:")


@pytest.mark.parametrize("text, where, words", [
    ("mask_mod = q_idx - kv_idx", (1, 12),
     "mask_mod must be a boolean, but this expression is i32"),
    ("score_mod = score > 0", (1, 13), "score_mod must be a number"),
    ("variant v(t: tensor f32[S])\nscore_mod = score + t[q_idx / 2]", (2, 23),
     "an index into 't' must be an integer, but this is f32"),
    ("variant v(t: tensor f32[S])\nscore_mod = score + t[q_idx > 2]", (2, 23), "is a boolean"),
    ("query_mod = q[d * 0.5]", (1, 15), "an index into 'q' must be an integer"),
    ("variant v(t: tensor f32[H, S])\nscore_mod = score + t[h]", (2, 21), "has rank 2"),
    ("variant v(t: tensor f32[H, S])\nscore_mod = score + t", (2, 21), "rank 2"),
    ("score_mod = score & 1", (1, 19), "'&' combines booleans, but its left operand is f32"),
    ("mask_mod = (q_idx > 1) | kv_idx", (1, 24), "its right operand is i32"),
    ("mask_mod = ~q_idx", (1, 12), "'~' negates a boolean"),
    ("score_mod = where(q_idx, score, 0)", (1, 19), "where()'s condition must be a boolean"),
])
def test_type_errors(text, where, words):
    msg = error_of(text)
    assert words in msg, msg
    assert caret_at(msg) == where, msg


def test_let_used_by_a_hook_without_its_variable():
    msg = error_of("let rope_pos = f32(q_idx) * f32(d)\nlet both = rope_pos + 1.0\n"
                   "score_mod = score * both")
    assert caret_at(msg) == (3, 21)
    assert "cannot use let 'both': it reads 'd', which score_mod does not have" in msg
    # the note points at `d` inside the first let, through the second
    assert "t.attn:1:33: note: 'both' reads 'd' here" in msg
    # the same let is fine where `d` exists
    ir, _ = parse_attn("let rope_pos = f32(q_idx) * f32(d)\nquery_mod = q[d] * rope_pos")
    assert ir.hooks["query_mod"]


def test_error_is_attncc_error_and_syntax_error():
    from attncc.errors import AttnccError

    with pytest.raises(AttnccError):
        parse_attn("mask_mod = ")
    with pytest.raises(SyntaxError):
        parse_attn("mask_mod = ")


def test_load_attn_reports_the_path(tmp_path):
    p = tmp_path / "bad.attn"
    p.write_text("# header\nmask_mod = q_idx >= kv_idx &&\n")
    with pytest.raises(AttnSyntaxError) as info:
        load_attn(p)
    assert str(info.value).startswith(f"{p}:2:29: error: unexpected '&'")
