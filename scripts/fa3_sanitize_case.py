"""One small FA3 launch for compute-sanitizer (memcheck, racecheck): checked against the fp64
reference, so a clean sanitizer log comes from a launch that also computed the right thing.

    compute-sanitizer --tool memcheck python -m scripts.fa3_sanitize_case
    compute-sanitizer --tool racecheck python -m scripts.fa3_sanitize_case dense64

Under memcheck the H200 image reports 34 CUDA API errors, all failed cuGetProcAddress lookups
made while the libraries load; `--report-api-errors no` leaves the kernels' own (expected: 0).

Arguments pick parts (default: all): dense64, dense128, transforms, batch, document, split,
pairs, pairs_small (the one to racecheck the pair form with), padded (head dims FA3 runs in a
wider tile: 96, 160 with a box wholly past the real columns, 192/128), short_table (captured reads
clamped by attncc, under PYTORCH_NO_CUDA_MEMORY_CACHING=1).
Racecheck instruments every shared-memory access, so the whole script takes minutes under it;
one part does not.

Dense FA3 (kernels/fa3/fa3_prefill.cuh, persistent): odd lengths (a partial last query block and a
partial last KV tile), GQA 2, a causal block mask (partial and full blocks) and a softcap
score_mod, at head dims 64 and 128, with more 128-row items than SMs so CTAs run several; then
RoPE (query/key transforms) and value/output transforms at head dim 64, in the kernel and in the
transform pre-pass (kernels/small/prepass.cuh).
FA3 batch (kernels/fa3/fa3_batch.cuh): a paged (page 16) and a ragged batch of odd-length prefill
chunks with a long request split across CTAs (so the merge kernel runs), causal, RoPE and
value/output variants.
"""
from __future__ import annotations

import itertools
import sys
from typing import Any

import torch

import attncc
from attncc.gym import GYM, causal
from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import attention_reference, batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention


def _value_output(d: int) -> attncc.Variant:
    return attncc.Variant(value_mod=lambda v, b, h, kv, i: v[i] - 0.5 * v[(i + 1) % d],
                          output_mod=lambda o, b, h, q, i: 2.0 * o[i] + o[d - 1 - i],
                          name="value_output")


def _check_fa3(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: Any,
               bind: Any, options: dict[str, Any] | None = None, **kw: Any) -> None:
    """One dense FA3 launch into a NaN-poisoned output (value's head dim wide), checked whole
    against the fp64 reference (`kw`: enable_gqa, block_mask)."""
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), device=q.device, dtype=q.dtype)
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, out=out,
                                kernel_options={"KERNEL": "fa3", **(options or {})}, **kw)
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, ir, bind, **kw)
    err = float((out.double() - ref).norm() / ref.norm())
    assert not torch.isnan(out).any() and err < 2e-2, (label, err)
    print(f"{label}: FA3 rel err {err:.1e}")


def dense_transforms() -> None:
    d, S, Hq, Hkv = 64, 200, 72, 36  # 2 x 72 x 2 = 288 items: CTAs run two or three
    for (name, variant), prepass in itertools.product(
            (("rope", GYM["rope"](2, Hq, S, d)), ("value_output", _value_output(d))),
            ("none", "qkv")):
        q = torch.randn(2, Hq, S, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, Hkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        ir, bind = variant.trace()
        _check_fa3(f"dense {name} d={d} prepass={prepass}", q, k, v, ir, bind,
                   {"PREPASS": prepass}, enable_gqa=True)


def batch() -> None:
    d, Hkv, g, page = 64, 2, 2, 16
    q_lens, kv_lens = [130, 1, 70], [1500, 5, 70]
    qo = torch.tensor([0, *itertools.accumulate(q_lens)])
    q = torch.randn(int(qo[-1]), Hkv * g, d, device="cuda", dtype=torch.bfloat16)
    for layout in ("NHD", "ragged"):
        if layout == "ragged":
            kv_indptr = torch.tensor([0, *itertools.accumulate(kv_lens)])
            k, v = (torch.randn(sum(kv_lens), Hkv, d, device="cuda", dtype=torch.bfloat16)
                    for _ in "kv")
            ids = last = None
        else:
            n_pages = [-(-n // page) for n in kv_lens]
            kv_indptr = torch.tensor([0, n_pages[0], n_pages[0] + n_pages[1], sum(n_pages)])
            ids = torch.randperm(sum(n_pages) + 4)[:sum(n_pages)]
            last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
            k, v = (torch.randn(sum(n_pages) + 4, page, Hkv, d, device="cuda",
                                dtype=torch.bfloat16) for _ in "kv")
        for name, variant in (("causal", GYM["causal"](1, Hkv * g, 4096, d)),
                              ("rope", GYM["rope"](1, Hkv * g, 4096, d)),
                              ("value_output", _value_output(d))):
            ba = BatchAttention(variant, kv_layout=layout, kernel="fa3")
            ba.plan(qo, kv_indptr, ids, last, num_qo_heads=Hkv * g, num_kv_heads=Hkv,
                    head_dim=d, page_size=page if layout != "ragged" else 1)
            out = torch.full_like(q, float("nan"))
            ba.run(q, (k, v), out=out)
            torch.cuda.synchronize()
            ref, _ = batch_attention_reference(q, (k, v), qo, kv_indptr, ids, last,
                                               kv_layout=layout, page_size=page
                                               if layout != "ragged" else 1, variant=variant)
            err = float((out.double() - ref).norm() / ref.norm())
            assert not torch.isnan(out).any() and err < 2e-2, (layout, name, err)
            merges = ba._plan.num_merges if ba._plan is not None else 0
            print(f"batch {layout} {name}: FA3 rel err {err:.1e} ({merges} merged rows)")


def dense(d: int) -> None:
    S, Hq, Hkv = 300, 72, 36  # 2 x 72 x 3 = 432 items on at most 132 persistent CTAs
    q = torch.randn(2, Hq, S, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, Hkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    ir, bind = attncc.Variant(score_mod=GYM["softcap"](1, Hq, S, d).score_mod).trace()
    _check_fa3(f"d={d}", q, k, v, ir, bind, block_mask=bm, enable_gqa=True)


def document(d: int = 64) -> None:
    """Document masks at odd lengths: a hook that indexes a captured [B, S] tensor by q_idx and
    kv_idx, on partial query blocks and a partial last KV tile. Run with
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 so the doc-id tensor is its own allocation and memcheck
    sees a read past its end (the FA3 checked path once gave the hooks positions past the
    sequence). With document_causal alone memcheck saw nothing even before that fix
    (the causal half likely skips the loads past the diagonal); document_mask has no such
    short cut."""
    B, S, H = 2, 300, 4
    for name in ("document_mask", "document_causal"):
        variant = GYM[name](B, H, S, d)
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        ir, bind = variant.trace()
        _check_fa3(f"{name} d={d} S={S}", q, k, v, ir, bind)


def short_table(d: int = 64) -> None:
    """Captured reads that leave their tensor only at masked positions (docs/semantics.md): a
    [H, S] distance table read at table[h, q_idx - kv_idx] under causal -- q_idx - kv_idx < 0
    above the diagonal, which the kernel evaluates on partial tiles -- and the same through an
    index read from a tensor (pos[q_idx], undecided by the analysis), at an odd length. Both run
    clamped; run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so each table is its own allocation and
    memcheck would see a read past it."""
    B, S, H = 2, 300, 4
    table = torch.randn(H, S, device="cuda")
    pos = torch.arange(S, device="cuda")

    def distance_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + table[h, q_idx - kv_idx]

    def indirect_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + table[h, pos[q_idx] - kv_idx]

    for name, fn in (("distance", distance_bias), ("indirect", indirect_bias)):
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        ir, bind = attncc.Variant(score_mod=fn, mask_mod=causal).trace()
        _check_fa3(f"short table {name} d={d} S={S}", q, k, v, ir, bind)


def split_tail() -> None:
    """Full attention with more items than CTAs and a partial last round (kernels/
    fa3_split.cuh): 165 items of 33 tiles (a partial last one), the last 33 cut into 132 pieces
    whose units park their state in the workspace and merge (head dim 64, GQA 5)."""
    S, Hq, Hkv, d = 4100, 5, 1, 64
    q = torch.randn(1, Hq, S, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    ir, bind = GYM["softcap"](1, Hq, S, d).trace()
    _check_fa3(f"split tail d={d} S={S}", q, k, v, ir, bind, enable_gqa=True)


def pairs(d: int = 128, S: int = 1024, Hq: int = 40, Hkv: int = 8) -> None:
    """Full attention on CTA pairs (kernel_options PAIRED, the default up to 8192 keys; kernels/
    fa3_prefill.cuh produce_pairs): by default 2 x 40 x 8 = 640 items, 320 pairs on at most 66
    clusters of two, each K/V tile multicast into both CTAs' rings and released by both CTAs'
    consumers. The `pairs_small` part (for racecheck: 2 x 80 x 2 items of two 128-key tiles at
    head dim 64) still gives every cluster two or three pairs, so rings are reused across items."""
    q = torch.randn(2, Hq, S, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, Hkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    ir, bind = GYM["softcap"](2, Hq, S, d).trace()
    assert gpu_flex.plan_launch(q, k, v, ir, bind, enable_gqa=True,
                                kernel_options={"KERNEL": "fa3"}).tiles.paired
    _check_fa3(f"pairs d={d} S={S}", q, k, v, ir, bind, enable_gqa=True)


def padded() -> None:
    """The padded form (head dims read through TMA maps of their real widths): q/k/v boxes
    partly (96 of 128) and wholly (160 of 256: columns 192-255) past the real columns, and a
    value dim other than the query's (192/128), causal with softcap, odd lengths and GQA 2.
    Memcheck sees a store past O's Dv columns or a load past q/k/v's real widths."""
    S, Hq, Hkv = 300, 8, 4
    for dqk, dv in ((96, 96), (160, 160), (192, 128)):
        q = torch.randn(2, Hq, S, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, Hkv, S, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, Hkv, S, dv, device="cuda", dtype=torch.bfloat16)
        bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
        ir, bind = attncc.Variant(score_mod=GYM["softcap"](1, Hq, S, dqk).score_mod).trace()
        _check_fa3(f"padded {dqk}/{dv} S={S}", q, k, v, ir, bind, block_mask=bm, enable_gqa=True)


PARTS = {"dense64": lambda: dense(64), "dense128": lambda: dense(128),
         "transforms": dense_transforms, "batch": batch, "document": document,
         "split": split_tail, "pairs": pairs, "padded": padded, "short_table": short_table,
         "pairs_small": lambda: pairs(64, 256, 80, 16)}


def main() -> None:
    torch.manual_seed(0)
    chosen = sys.argv[1:] or list(PARTS)
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    for part in chosen:
        PARTS[part]()


if __name__ == "__main__":
    main()
