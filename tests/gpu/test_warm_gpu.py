"""`attncc warm` on the GPU machine: after warming a fresh cache directory for a shape, the
first flex_attention call of that shape compiles nothing (no NVRTC call, no rendering: every
form is a disk hit of the form memo) and is correct against the fp64 reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import attncc
from attncc.cli import main
from attncc.gym import softcap_causal
from attncc.runtime.jit import cache, kernels
from attncc.runtime.jit.cache import KernelCache
from attncc.runtime.jit.forms import FormMemo
from attncc.runtime.jit.kernels import clear_loaded
from attncc.runtime.jit.nvrtc import device_arch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block_mask", [False, True])
def test_warmed_call_compiles_nothing(tmp_path, monkeypatch, block_mask: bool) -> None:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    B, H, S, D = 3, 12, 1664, 128  # a shape no other test plans (nothing in memory to reuse)
    args = ["warm", "attncc.gym:softcap_causal", "--shape", f"{B},{H},{S}", "--head-dim",
            str(D), "--arch", device_arch(), "--sms",
            str(torch.cuda.get_device_properties(0).multi_processor_count)]
    assert main(args + (["--block-mask"] if block_mask else [])) == 0
    KernelCache._defaults.clear()
    clear_loaded()

    def refuse(*a, **kw):
        raise AssertionError("the warmed call compiled or rendered a kernel")

    for module, name in ((cache, "compile_cuda"), (kernels, "compile_form")):
        monkeypatch.setattr(module, name, refuse)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if block_mask:
        bm = attncc.create_block_mask(softcap_causal.mask_mod, B, H, S, S, device="cuda")
        variant = dataclasses.replace(softcap_causal, mask_mod=None)  # what warm traced
        out = attncc.flex_attention(q, k, v, score_mod=variant, block_mask=bm)
    else:
        out = attncc.flex_attention(q, k, v, score_mod=softcap_causal)
    torch.cuda.synchronize()
    stats = FormMemo.default().store.stats
    assert stats["misses"] == 0 and stats["disk_hits"] >= 1, stats
    ref = attncc.flex_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                score_mod=softcap_causal)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert not torch.isnan(out).any() and err < 2e-2
