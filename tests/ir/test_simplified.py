"""attncc.ir.simplified: simplify_variant remembered per process and in a byte store, so a warm
start never imports sympy (docs/jit.md, "Warm start")."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attncc
from attncc.ir import simplified
from attncc.ir.simplify import simplify_variant as simplify_now


@pytest.fixture
def store():
    """A dict-backed store installed for the test; the runtime's store comes back after."""
    saved = simplified._store
    data: dict[str, bytes] = {}
    simplified.use_store(data.get, data.__setitem__)
    simplified.clear_memo()
    yield data
    simplified._store = saved
    simplified.clear_memo()


def _ir(cap: float = 30.0, normalize: str = "softmax"):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) * 1.0 + 0.0

    return attncc.Variant(score_mod=softcap, mask_mod=lambda b, h, q, kv: (q >= kv) & True,
                          normalize=normalize).trace()[0]


def test_same_result_as_simplifying_now(store: dict) -> None:
    ir = _ir()
    got = simplified.simplify_variant(ir)
    assert got.format() == simplify_now(ir).format()
    assert got is simplified.simplify_variant(ir)  # the process memo
    assert len(store) == 1


def test_store_answers_without_the_simplifier(store: dict, monkeypatch) -> None:
    """A second 'process' (memo cleared) gets the stored result even when the simplifier cannot
    be imported at all."""
    ir = _ir()
    first = simplified.simplify_variant(ir)
    simplified.clear_memo()
    monkeypatch.setitem(sys.modules, "attncc.ir.simplify", None)  # import now raises
    again = simplified.simplify_variant(ir)
    assert again.format() == first.format() and again.hooks.keys() == first.hooks.keys()
    for name, hook in again.hooks.items():
        assert hook.expr is first.hooks[name].expr  # nodes re-interned on load


def test_keys_separate_what_the_ir_separates(store: dict) -> None:
    simplified.simplify_variant(_ir())
    simplified.simplify_variant(_ir(normalize="none"))
    simplified.simplify_variant(_ir(cap=20.0))  # a captured scalar: the same traced IR
    assert len(store) == 2


def test_an_unreadable_entry_is_simplified_again(store: dict) -> None:
    ir = _ir()
    simplified.simplify_variant(ir)
    (key,) = store
    store[key] = b"not a pickle"
    simplified.clear_memo()
    assert simplified.simplify_variant(ir).format() == simplify_now(ir).format()
    assert store[key] != b"not a pickle"  # rewritten


@pytest.mark.parametrize("run", ["first", "warm"])
def test_a_warm_process_never_imports_sympy(tmp_path, run: str) -> None:
    """End to end through the runtime's store (the kernel cache directory): the first process
    simplifies (sympy imported); a new process with the same cache calls flex_attention on the
    CPU without importing sympy."""
    code = textwrap.dedent("""
        import sys, torch, attncc
        q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
        def softcap(score, b, h, q_idx, kv_idx):
            return 30 * torch.tanh(score / 30)
        attncc.flex_attention(q, k, v, score_mod=softcap)
        print("sympy" in sys.modules)
    """)
    env = {**os.environ, "ATTNCC_CACHE_DIR": str(tmp_path)}
    outs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
            for _ in range(1 if run == "first" else 2)]
    assert outs[-1] == ("True" if run == "first" else "False")
