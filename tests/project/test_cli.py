"""The `attncc` command line: compile / export / explain, in-process, plus one real subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from attncc.cli import load_target, main
from attncc.frontend.text import load_attn
from attncc.ir.simplify import simplify_variant
from tests import helpers

ROOT = str(helpers.ROOT)
SOFTCAP = os.path.join(ROOT, "examples", "softcap_window.attn")

MODS_PY = textwrap.dedent("""
    import torch
    import attncc

    cap = 20.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    class holder:
        both = attncc.Variant(score_mod=softcap, mask_mod=causal, name="both")

    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score

    not_a_variant = 3
""")


@pytest.fixture
def mods(tmp_path, monkeypatch):
    """A user module `attncc_cli_mods` on sys.path, also reachable as a .py path."""
    path = tmp_path / "attncc_cli_mods.py"
    path.write_text(MODS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("attncc_cli_mods", None)
    sys.modules.pop("_attncc_target_attncc_cli_mods", None)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_compile_emit_ir_for_attn_file(capsys):
    rc, out, err = run(capsys, "compile", SOFTCAP, "--emit", "ir")
    assert rc == 0 and err == ""
    assert out == simplify_variant(load_attn(SOFTCAP)[0]).format() + "\n"
    assert out.startswith("variant softcap_window (normalize=softmax)")


def test_compile_emit_ir_for_module_function_and_py_path(capsys, mods):
    rc, out, _ = run(capsys, "compile", "attncc_cli_mods:softcap", "--emit", "ir")
    assert rc == 0
    assert "param cap: f32" in out and "return cap * tanh(score / cap)" in out
    # a path to a .py file, a dotted attribute, and a Variant object
    rc, out2, _ = run(capsys, "compile", f"{mods}:holder.both", "--emit", "ir")
    assert rc == 0
    assert out2.startswith("variant both") and "q_idx >= kv_idx" in out2
    # a mask_mod function is recognised by its 4 arguments
    ir, _ = load_target("attncc_cli_mods:causal")
    assert list(ir.hooks) == ["mask_mod"]


def test_compile_ir_to_output_file(capsys, tmp_path):
    out_path = tmp_path / "sub" / "ir.txt"
    rc, out, err = run(capsys, "compile", SOFTCAP, "--emit", "ir", "-o", str(out_path))
    assert rc == 0 and out == "" and "wrote" in err
    assert out_path.read_text().startswith("variant softcap_window")


def test_compile_emit_cuda(capsys):
    rc, out, _ = run(capsys, "compile", SOFTCAP, "--emit", "cuda", "--head-dim", "64",
                     "--dtype", "float16")
    assert rc == 0
    assert 'extern "C" __global__' in out
    assert "attncc_softcap_window_simple_d64_f16" in out
    assert "tanhf(score / p.cap)" in out


def test_explain_has_three_sections_in_order(capsys):
    rc, out, _ = run(capsys, "explain", SOFTCAP)
    assert rc == 0
    titles = ["== traced IR ==", "== simplified IR ==", "== CUDA hook bodies =="]
    positions = [out.index(t) for t in titles]
    assert positions == sorted(positions)
    hooks = out[positions[2]:]
    assert "float LogitsTransform(" in hooks and "bool LogitsMask(" in hooks
    assert "return p.cap * tanhf(score / p.cap);" in hooks
    assert "QueryTransform" not in hooks  # identity hooks produce no code


def test_explain_shows_simplification(capsys, tmp_path):
    p = tmp_path / "redundant.attn"
    p.write_text("score_mod = score * 1.0 + 0.0 + f32(h) * 0.0\nmask_mod = q_idx >= kv_idx\n")
    rc, out, _ = run(capsys, "explain", str(p))
    assert rc == 0
    traced = out.split("== simplified IR ==")[0]
    simplified = out.split("== simplified IR ==")[1].split("== CUDA hook bodies ==")[0]
    assert "score_mod" in traced and "score_mod" not in simplified


def test_export_writes_a_standalone_cu(capsys, tmp_path):
    target = tmp_path / "out" / "rope.cu"
    rc, out, err = run(capsys, "export", os.path.join(ROOT, "examples", "rope.attn"), "-o",
                       str(target), "--head-dim", "128", "--dtype", "bfloat16")
    assert rc == 0 and out == ""
    text = target.read_text()
    assert "attncc_rope_simple_d128_bf16_launch(" in text and "__global__" in text
    assert "KeyTransform" in text and "QueryTransform" in text


def test_export_needs_output(capsys):
    rc, _, err = run(capsys, "export", SOFTCAP)
    assert rc == 2 and "-o" in err


# ----------------------------------------------------------------------------- errors


def test_syntax_error_exits_2_with_location_and_caret(capsys, tmp_path):
    p = tmp_path / "bad.attn"
    p.write_text("variant bad\nscore_mod = score * d\n")
    rc, out, err = run(capsys, "compile", str(p), "--emit", "ir")
    assert rc == 2 and out == ""
    assert err.startswith(f"{p}:2:21: error: score_mod cannot read 'd'")
    assert "   |                     ^" in err
    assert "Traceback" not in err


def test_trace_error_exits_2(capsys, mods):
    rc, out, err = run(capsys, "compile", "attncc_cli_mods:branchy", "--emit", "ir")
    assert rc == 2 and out == ""
    assert err.startswith("attncc: error: ") and "torch.where" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["compile", "missing.attn", "--emit", "ir"], "no such file: missing.attn"),
    (["compile", "just_a_name", "--emit", "ir"], "give FILE.attn or module:function"),
    (["compile", "x.py", "--emit", "ir"], "name the variant inside the file"),
    (["compile", "attncc_cli_mods:nope", "--emit", "ir"], "has no attribute 'nope'"),
    (["compile", "attncc_cli_mods:not_a_variant", "--emit", "ir"], "it must be an attncc.Variant"),
    (["compile", "no_such_module_xyz:f", "--emit", "ir"], "cannot import module"),
    (["compile", "attncc_cli_mods:softcap"], "give -o OUT.cubin"),
    (["compile", "attncc_cli_mods:softcap", "--emit", "cuda", "--head-dim", "100"],
     "supports head dims"),
    (["compile", "attncc_cli_mods:softcap", "--emit", "cuda", "--dtype", "int8"],
     "dtype='int8'"),
    (["compile", "attncc_cli_mods:softcap", "--emit", "ptx", "--arch", "gpu9000"],
     "--arch gpu9000: not a GPU architecture"),
])
def test_usage_errors_exit_2_cleanly(capsys, mods, argv, words):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("attncc: error: ") and words in err, err
    assert "Traceback" not in err


def test_argparse_errors_return_2(capsys):
    rc, _, err = run(capsys, "compile", SOFTCAP, "--emit", "asm")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = run(capsys, "compile", SOFTCAP, "--head-dim", "-4", "--emit", "ir")
    assert rc == 2 and "not positive" in err
    rc, _, _ = run(capsys)
    assert rc == 2


def test_help_lists_the_commands(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and all(c in out for c in ("compile", "export", "explain"))
    rc, out, _ = run(capsys, "compile", "--help")
    assert rc == 0 and "--emit" in out and "--arch" in out


def test_module_entry_point_in_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    bad = tmp_path / "oops.attn"
    bad.write_text("mask_mod = q_idx >= kv_idx and h < 2\n")
    r = subprocess.run([sys.executable, "-m", "attncc.cli", "compile", str(bad), "--emit", "ir"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert f"{bad}:1:28: error: unexpected name 'and'" in r.stderr
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- NVRTC


@pytest.mark.nvrtc
def test_compile_ptx_and_cubin(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "causal.attn"
    p.write_text("mask_mod = q_idx >= kv_idx\n")
    rc, out, _ = run(capsys, "compile", str(p), "--arch", "sm_80", "--head-dim", "32",
                     "--emit", "ptx")
    assert rc == 0
    assert ".target sm_80" in out and "attncc_causal_simple_d32_bf16" in out
    cubin = tmp_path / "causal.cubin"
    rc, out, err = run(capsys, "compile", str(p), "--arch", "sm_80", "--head-dim", "32",
                       "--emit", "cubin", "-o", str(cubin))
    assert rc == 0 and out == "" and "wrote" in err
    assert cubin.read_bytes()[:4] == b"\x7fELF"
