"""`attncc warm` (runtime/flex/warm.py): the kernels a flex_attention call plans, decided from
shapes and the GPU's facts without a GPU, compiled into the cache so the call only reads them."""
from __future__ import annotations

import pytest

from attncc.cli import main
from attncc.errors import InvalidArgument
from attncc.gym import GYM
from attncc.runtime.flex import warm
from attncc.runtime.jit import nvrtc
from attncc.runtime.jit.cache import KernelCache
from attncc.runtime.jit.kernels import compile_form


def _traced(name: str, block_mask: bool = False):
    v = GYM[name](1, 16, 4096, 128)
    return warm.split_block_mask(v) if block_mask else (*v.trace(), None)


def test_parse_shape() -> None:
    assert warm.parse_shape("2,16,4096") == warm.Shape(2, 16, 4096, 16, 4096)
    assert warm.parse_shape("1,32,8192,8") == warm.Shape(1, 32, 8192, 8, 8192)
    assert warm.parse_shape("1,8,1,2,9000") == warm.Shape(1, 8, 1, 2, 9000)
    for bad in ("1,16", "1,16,0", "a,b,c", "1,6,64,4"):
        with pytest.raises(InvalidArgument, match="shape"):
            warm.parse_shape(bad)


def test_specs_follow_the_arch_and_the_block_mask() -> None:
    """A dense causal call on an H200 runs the FA3 kernel on CTA pairs; the same mask given as
    a block mask runs unpaired FA3 (pairs need no block mask); an A100 runs FA2."""
    shape = warm.parse_shape("1,16,4096")
    ir, b, m = _traced("causal")
    (fa3,) = warm.warm_specs(ir, b, shape, head_dim=128, dtype="bfloat16", arch="sm_90a")
    assert fa3.kind == "fa3_prefill" and fa3.paired
    ir, b, m = _traced("causal", block_mask=True)
    (blk,) = warm.warm_specs(ir, b, shape, head_dim=128, dtype="bfloat16", arch="sm_90a",
                             mask_mod=m)
    assert blk.kind == "fa3_prefill" and not blk.paired and blk.ir.hooks != fa3.ir.hooks
    ir, b, m = _traced("causal")
    (fa2,) = warm.warm_specs(ir, b, shape, head_dim=128, dtype="float16", arch="sm_80")
    assert fa2.kind == "fa2_prefill" and fa2.dtype == "float16"


def test_transforms_bring_their_prepass() -> None:
    ir, b, m = _traced("rope")
    kinds = [s.kind for s in warm.warm_specs(ir, b, warm.parse_shape("2,16,2048,4"),
                                             head_dim=128, dtype="bfloat16", arch="sm_80")]
    assert kinds == ["fa2_prefill", "prepass"]


def test_bad_arguments_are_named() -> None:
    ir, b, m = _traced("causal")
    shape = warm.parse_shape("1,16,512")
    with pytest.raises(InvalidArgument, match="--sms"):
        warm.warm_specs(ir, b, shape, head_dim=128, dtype="bfloat16", arch="sm_100a")
    with pytest.raises(InvalidArgument, match="bfloat16 or float16"):
        warm.warm_specs(ir, b, shape, head_dim=128, dtype="float32", arch="sm_90a")
    with pytest.raises(InvalidArgument, match="no mask_mod"):
        warm.split_block_mask(GYM["softcap"](1, 16, 512, 128))
    assert main(["warm", "attncc.gym:softcap_causal", "--shape", "1,16", "--arch",
                 "sm_90a"]) == 2


@pytest.mark.nvrtc
@pytest.mark.skipif(not nvrtc.available(), reason="needs NVRTC")
def test_warm_fills_the_cache_a_call_reads(tmp_path, monkeypatch, capsys) -> None:
    """After `attncc warm`, compiling the planned form is a disk hit in a fresh cache object."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    assert main(["warm", "attncc.gym:sliding_window_causal", "--shape", "2,8,1024",
                 "--head-dim", "64", "--arch", "sm_80", "--jobs", "1"]) == 0
    assert "fa2_prefill" in capsys.readouterr().out
    from attncc.gym import sliding_window_causal

    ir, b = sliding_window_causal.trace()
    (spec,) = warm.warm_specs(ir, b, warm.parse_shape("2,8,1024"), head_dim=64,
                              dtype="bfloat16", arch="sm_80")
    KernelCache._defaults.clear()  # a new process's cache object: memory empty
    form = compile_form(spec, "sm_80")
    cache = KernelCache.default()
    assert cache.stats["disk_hits"] >= 1 and cache.stats["misses"] == 0, cache.stats
    assert form.result.cubin[:4] == b"\x7fELF"
