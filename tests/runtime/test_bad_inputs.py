"""Every bad input is a clear, early error naming the argument and the fix (issue 27, point 6).

Each test pins one finding: before the fix the call raised an unrelated Python error
(ZeroDivisionError, "'float' object is not iterable", RecursionError, torch's CUDA assertion,
a ptxas error) or silently accepted the input.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attncc
from attncc.errors import (AttnccError, AttnSyntaxError, CompileError, DeviceError,
                           InvalidArgument, InvalidArgumentType, TraceError)
from attncc.frontend.text import MAX_DEPTH, parse_attn
from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.plan.checks import check_batch
from attncc.runtime.jit.compile import check_kernel_arch


def _qkv(rng, B=1, Hq=2, Hkv=2, Sq=8, Skv=8, D=16):
    return rng.randn(B, Hq, Sq, D), rng.randn(B, Hkv, Skv, D), rng.randn(B, Hkv, Skv, D)


# ------------------------------------------------------------------ flex_attention sizes / flags
@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_zero_heads_is_a_clear_error(which: str, rng) -> None:
    q, k, v = _qkv(rng)
    args = {"query": q, "key": k, "value": v}
    args[which] = args[which][:, :0]
    with pytest.raises(InvalidArgument, match=f"{which} has shape .*0 heads"):
        attncc.flex_attention(args["query"], args["key"], args["value"], enable_gqa=True)


def test_zero_kv_heads_does_not_suggest_enable_gqa(rng) -> None:
    q, k, v = _qkv(rng)
    with pytest.raises(InvalidArgument, match="key has shape .*0 heads"):
        attncc.flex_attention(q, k[:, :0], v[:, :0])


def test_zero_head_dim_is_a_clear_error(rng) -> None:
    q, k, v = _qkv(rng, D=0)
    with pytest.raises(InvalidArgument, match="head_dim 0"):
        attncc.flex_attention(q, k, v)


@pytest.mark.parametrize("flag", ["enable_gqa", "return_lse"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_flags_must_be_bools(flag: str, value, rng) -> None:
    q, k, v = _qkv(rng)
    with pytest.raises(InvalidArgumentType, match=f"{flag} must be True or False"):
        attncc.flex_attention(q, k, v, **{flag: value})
    assert issubclass(InvalidArgumentType, TypeError)


def test_zero_keys_on_the_cpu_is_zero_output_and_minus_inf_lse(rng) -> None:
    q, k, v = _qkv(rng, Skv=0)
    out, lse = attncc.flex_attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(torch.all(lse == -math.inf))


def test_zero_keys_on_the_gpu_path_returns_before_any_launch(rng, monkeypatch) -> None:
    """gpu_flex_attention with Skv=0 answers from the reference (out = output_mod(0), lse -inf)
    and never plans, compiles or launches (a TMA map of an empty K failed in the driver)."""
    def no_launch(*a, **k):
        raise AssertionError("Skv=0 reached the launch planning")

    monkeypatch.setattr(gpu_flex, "_validate", lambda *a, **k: None)  # CPU tensors here
    monkeypatch.setattr(gpu_flex, "plan_launch", no_launch)
    q = rng.randn(1, 2, 8, 64).bfloat16()
    k = v = torch.zeros(1, 2, 0, 64, dtype=torch.bfloat16)
    bias = 0.5
    variant = attncc.Variant(output_mod=lambda o, b, h, q_idx, d: o[d] + bias)
    ir, bindings = variant.trace()
    out, lse = gpu_flex.gpu_flex_attention(q, k, v, ir, bindings, return_lse=True)
    assert out.dtype == torch.bfloat16 and bool(torch.all(out == 0.5))
    assert lse.dtype == torch.float32 and bool(torch.all(lse == -math.inf))


# ------------------------------------------------------------------ block masks
@pytest.mark.parametrize("bs", [1.5, "128", (128, 64.0), (128,), True])
def test_block_size_must_be_ints(bs) -> None:
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="BLOCK_SIZE"):
        attncc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256,
                                 BLOCK_SIZE=bs)


@pytest.mark.parametrize("arg,value", [("B", 0), ("H", 0), ("B", 1.5), ("Q_LEN", 2.5),
                                       ("KV_LEN", 0)])
def test_block_mask_sizes_are_checked(arg: str, value) -> None:
    sizes = {"B": 1, "H": 1, "Q_LEN": 128, "KV_LEN": 128, arg: value}
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=f"{arg} must be an int"):
        attncc.create_block_mask(lambda b, h, q, kv: q >= kv, sizes["B"], sizes["H"],
                                 sizes["Q_LEN"], sizes["KV_LEN"])


# ------------------------------------------------------------------ what a mod returns / calls
@pytest.mark.parametrize("ret,what", [(lambda s: torch.ones(3), r"a tensor of shape \(3,\)"),
                                      (lambda s: (s, s), "a tuple of 2 values"),
                                      (lambda s: [s], "a list of 1 values"),
                                      (lambda s: "score", "a value of type str")])
def test_mod_returning_many_values_names_the_mod(ret, what: str, rng) -> None:
    def shaped(score, b, h, q_idx, kv_idx):
        return ret(score)

    q, k, v = _qkv(rng)
    with pytest.raises(TraceError, match=f"score_mod 'shaped' returned {what}") as e:
        attncc.flex_attention(q, k, v, score_mod=shaped)
    msg = str(e.value)
    assert "test_bad_inputs.py" in msg and "flex.py" not in msg and "captured" not in msg


@pytest.mark.parametrize("call,name", [(lambda s, qi, ki: np.exp(s), "exp"),
                                       (lambda s, qi, ki: np.where(qi >= ki, s, 0.0), "where"),
                                       (lambda s, qi, ki: np.maximum(s, 0.0), "maximum"),
                                       (lambda s, qi, ki: np.asarray(s), "asarray")])
def test_numpy_on_a_traced_value_says_use_torch(call, name: str, rng) -> None:
    def uses_numpy(score, b, h, q_idx, kv_idx):
        return call(score, q_idx, kv_idx)

    q, k, v = _qkv(rng)
    with pytest.raises(TraceError, match=f"numpy's {name}\\(\\) is called on a traced value") \
            as e:
        attncc.flex_attention(q, k, v, score_mod=uses_numpy)
    assert "torch.exp" in str(e.value) and "__array" not in str(e.value)


# ------------------------------------------------------------------ .attn text
def test_deep_attn_expression_is_a_syntax_error_not_recursion() -> None:
    expr = " + ".join(["score"] * 3000)
    with pytest.raises(AttnSyntaxError, match=r"deep\.attn:2:\d+: error: expression too deeply "
                                              r"nested"):
        parse_attn(f"variant long\nscore_mod = {expr}\n", "deep.attn")
    # the hint's grouping: the same 3000 terms in 60 parenthesised runs of 50 parse
    grouped = "(" + ") + (".join(" + ".join(["score"] * 50) for _ in range(60)) + ")"
    parse_attn(f"score_mod = {grouped}\n")
    ir, _ = parse_attn("score_mod = " + " + ".join(["score"] * (MAX_DEPTH - 8)) + "\n")
    assert ir.expr("score_mod") is not None


def test_deep_attn_through_lets_is_a_syntax_error() -> None:
    lets = "let a0 = score\n" + "".join(
        f"let a{i} = " + " + ".join([f"a{i - 1}"] + ["1.5"] * 150) + "\n" for i in range(1, 4))
    with pytest.raises(AttnSyntaxError, match="score_mod nests 451 operations deep"):
        parse_attn(lets + "score_mod = a3\n", "lets.attn")


# ------------------------------------------------------------------ kernel vs arch
@pytest.mark.parametrize("kernel,arch", [("fa3", "sm_80"), ("fa3", "sm_100a"), ("fa3", "sm_90"),
                                         ("fa3batch", "sm_120"), ("fa2", "sm_75"),
                                         ("fa2batch", "sm_70")])
def test_kernel_arch_mismatch_is_refused_before_nvrtc(kernel: str, arch: str,
                                                      monkeypatch) -> None:
    from attncc.runtime.jit import compile as compile_mod

    def no_nvrtc(*a, **k):
        raise AssertionError("NVRTC was called")

    monkeypatch.setattr(compile_mod, "cached_compile", no_nvrtc)
    with pytest.raises(CompileError, match=f"kernel={kernel!r} .*{arch}") as e:
        attncc.compile(lambda b, h, q, kv: q >= kv, head_dim=128, arch=arch, kernel=kernel,
                       cache=False)
    assert "ptxas" not in str(e.value)


def test_kernel_arch_pairs_that_run_are_accepted() -> None:
    for kernel, arch in [("fa3", "sm_90a"), ("fa3batch", "sm_90a"), ("fa2", "sm_80"),
                         ("fa2", "sm_100a"), ("simple", "sm_70"), ("prepass", "sm_75")]:
        check_kernel_arch(kernel, arch)


def test_forced_fa3_on_another_gpu_names_fa2() -> None:
    for cap in [(8, 0), (10, 0), (12, 0)]:
        with pytest.raises(InvalidArgument, match=f"sm_{cap[0]}{cap[1]}.*'KERNEL': 'fa2'"):
            gpu_flex.check_forced_fa3(cap)
    gpu_flex.check_forced_fa3((9, 0))


# ------------------------------------------------------------------ serving
def test_batch_attention_without_cuda_says_what_runs_on_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="batch_attention_reference") as e:
        BatchAttention(attncc.Variant())
    assert isinstance(e.value, AttnccError) and isinstance(e.value, RuntimeError)
    BatchAttention(attncc.Variant(), device="cpu")  # planning needs no GPU


@pytest.mark.parametrize("kwargs,match", [({"max_batch": 0}, "max_batch"),
                                          ({"max_pages": 2.5}, "max_pages"),
                                          ({"balance": "no"}, "balance"),
                                          ({"min_kv_chunk": 0}, "min_kv_chunk")])
def test_batch_attention_constructor_checks(kwargs, match: str) -> None:
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=match):
        BatchAttention(attncc.Variant(), device="cpu", **kwargs)


def test_plan_with_zero_kv_heads_is_a_clear_error() -> None:
    ba = BatchAttention(attncc.Variant(), device="cpu")
    with pytest.raises(InvalidArgument, match="num_kv_heads must be an int >= 1"):
        ba.plan([0, 1], [0, 1], [0], [4], num_qo_heads=4, num_kv_heads=0, head_dim=64,
                page_size=16)


# (kwargs for plan/reference, the error): each is rejected by plan() and by the CPU reference
_BAD_BATCHES = [
    ({"kv_indices": [-1]}, "negative page id"),
    ({"kv_last_page_len": [17]}, r"kv_last_page_len must be in \[0, page_size=16\]"),
    ({"qo_indptr": [1, 2]}, "qo_indptr"),
    ({"qo_indptr": [0, 1, 2], "kv_indptr": [0, 2, 1], "kv_indices": [0, 1],
      "kv_last_page_len": [4, 4]}, "kv_indptr"),
    ({"qo_indptr": [0, 2, 1], "kv_indptr": [0, 1, 2], "kv_indices": [0, 1],
      "kv_last_page_len": [4, 4]}, "qo_indptr"),
    ({"kv_indptr": [1, 2]}, "kv_indptr"),
    ({"page_size": 0}, "page_size"),
]


def _batch_args(**over):
    args = {"qo_indptr": [0, 1], "kv_indptr": [0, 1], "kv_indices": [0],
            "kv_last_page_len": [4], "page_size": 16}
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", _BAD_BATCHES)
def test_reference_runs_the_checks_plan_runs(over, match: str, rng) -> None:
    a = _batch_args(**over)
    ba = BatchAttention(attncc.Variant(), device="cpu")
    with pytest.raises(ValueError, match=match) as from_plan:
        ba.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"],
                num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=a["page_size"])
    page = max(a["page_size"], 1) if isinstance(a["page_size"], int) else 16
    q = rng.randn(4, 4, 64)
    k, v = rng.randn(4, page, 2, 64), rng.randn(4, page, 2, 64)
    with pytest.raises(ValueError, match=match) as from_reference:
        batch_attention_reference(q, (k, v), a["qo_indptr"], a["kv_indptr"], a["kv_indices"],
                                  a["kv_last_page_len"], page_size=a["page_size"])
    assert type(from_plan.value) is type(from_reference.value)


def test_reference_checks_the_cache_against_the_batch(rng) -> None:
    q = rng.randn(1, 4, 64)
    k, v = rng.randn(2, 16, 2, 64), rng.randn(2, 16, 2, 64)
    with pytest.raises(InvalidArgument, match=r"k_cache has shape \(2, 16, 2, 64\)"):
        batch_attention_reference(q, (k, v), [0, 1], [0, 1], [5], [4], page_size=16)
    with pytest.raises(InvalidArgument, match="page_size=8"):
        batch_attention_reference(q, (k, v), [0, 1], [0, 1], [1], [4], page_size=8)


def test_check_batch_is_shared() -> None:
    b = check_batch([0, 1], [0, 1], [3], [4], kv_layout="NHD", num_qo_heads=4, num_kv_heads=2,
                    head_dim=96, page_size=16, head_dims=None)
    assert b.max_page == 4 and b.kv_lens.tolist() == [4]
    with pytest.raises(InvalidArgument, match="head_dim=96"):
        check_batch([0, 1], [0, 1], [3], [4], kv_layout="NHD", num_qo_heads=4,
                    num_kv_heads=2, head_dim=96, page_size=16)


# ------------------------------------------------------------------ export / command line
def test_export_header_names_the_file_written(tmp_path) -> None:
    variant = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    p = attncc.export(variant, tmp_path / "softcap_fa2.cu", head_dim=128, kernel="fa2")
    text = p.read_text()
    assert "-c softcap_fa2.cu\n" in text and "-c attncc_causal" not in text
    d = attncc.export(variant, tmp_path, head_dim=64)
    assert f"-c {d.name}\n" in d.read_text()


def test_cli_export_header_names_the_output(tmp_path) -> None:
    from attncc.cli import main

    src = tmp_path / "causal.attn"
    src.write_text("mask_mod = q_idx >= kv_idx\n")
    out = tmp_path / "mine.cu"
    assert main(["export", str(src), "-o", str(out), "--head-dim", "64"]) == 0
    assert "-c mine.cu\n" in out.read_text()


def test_cli_kernel_help_lists_every_template(capsys) -> None:
    from attncc.cli import KERNEL_HELP, main
    from attncc.codegen.generate import KERNELS

    assert set(KERNEL_HELP) == set(KERNELS)
    main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in KERNELS:
        assert f"{name} (" in text
    assert main(["export", "x.attn", "-o", "x.cu", "--kernel", "fa4"]) == 2


def test_exported_fa3_header_does_not_offer_other_targets(tmp_path) -> None:
    variant = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    fa3 = attncc.export(variant, tmp_path / "c3.cu", head_dim=128, kernel="fa3").read_text()
    assert "any sm_80+ target works" not in fa3 and "runs only on sm_90a" in fa3
    fa2 = attncc.export(variant, tmp_path / "c2.cu", head_dim=128, kernel="fa2").read_text()
    assert "any sm_80+ target works" in fa2
