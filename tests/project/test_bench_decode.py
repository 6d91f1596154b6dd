"""bench/decode.py's FlexAttention paged-helper setup computes the same attention as attncc's
fp64 batch reference on the same pages (CPU, eager FlexAttention)."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from attncc.runtime.reference import batch_attention_reference


def test_flex_paged_call_matches_the_reference() -> None:
    from bench.decode import PAGE, flex_paged_call

    torch.manual_seed(0)
    lens = np.array([37, 5, 64, 100])
    npg = -(-lens // PAGE)
    total = int(npg.sum()) + 3                                   # unused pages in the pool
    perm = np.random.default_rng(0).permutation(total)[:int(npg.sum())]
    ind = np.concatenate([[0], np.cumsum(npg)])
    k = torch.randn(total, PAGE, 2, 32)
    v, q = torch.randn_like(k), torch.randn(lens.size, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                          # flex on CPU warns (eager)
        out = flex_paged_call(q, k, v, perm, ind, lens, compile=False)()[:, :, 0]
    ref, _ = batch_attention_reference(q, (k, v), np.arange(lens.size + 1), ind, perm,
                                       lens - (npg - 1) * PAGE, page_size=PAGE)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_multi_token_records_get_their_own_table() -> None:
    """The committed decode results with multi-token records added: the decode table is
    unchanged, and the multi-token cells follow in their own table (batch, kv, tokens, impl,
    fraction, tiles)."""
    import json

    from bench.decode import table
    from tests.helpers import ROOT

    doc = json.loads((ROOT / "bench/results/decode-h200.json").read_text())
    before = table(doc)
    rec = {"impl": "attncc_tree", "batch": 32, "hq": 64, "hkv": 8, "kv_len": 8192,
           "q_per_request": 8, "kv_dtype": "bfloat16", "ms": 0.5, "tb_s": 4.3,
           "bw_fraction": 0.91, "tq": 64, "tkv": 64, "stages": 3}
    after = table({**doc, "results": doc["results"] + [rec]})
    assert after.startswith(before.rstrip("\n"))
    assert "| 32 | 8192 | 8 | attncc_tree |  | 0.91 (4.30) | 64/64/3 | 500.0 |" in after


def test_multi_token_batch_matches_its_mask() -> None:
    """The bench's multi-token plans: `tokens` queries per request, the packed tree sized for
    [tokens, kv_len] per request and accepted by plan()'s checks."""
    from attncc.runtime.serving.tree_mask import tree_rows
    from bench.decode import multi_token_batch

    b = multi_token_batch(3, 100, 8, tree_seed=1)
    rows = tree_rows(None, b["mask"]["packed_custom_mask"], b["qo_indptr"], np.full(3, 100))
    assert rows.shape == (3, 16) and (rows[:, 0] == 1).all()
    assert b["kv_indices"].size == 3 * 7 and sorted(b["kv_indices"].tolist()) == list(range(21))


def test_kv_cells_table_section() -> None:
    """The KV-dtype cells (records with kv_len) get their own table section, one row each, and
    stay out of the main table and the plot's cells."""
    from bench.decode import table

    meta = {"gpu": "H200", "torch": "2.11", "attncc_commit": "0123456789ab",
            "date": "2026-12-02", "copy_tb_s": 4.25}
    cells = [dict(impl="attncc", batch=128, hq=64, hkv=8, kv_len=32768, q_per_request=1,
                  kv_dtype=name, ms=ms, tb_s=tbs, bw_fraction=tbs / 4.25, vs_bf16=ms / 3.0)
             for name, ms, tbs in (("bfloat16", 3.0, 4.0), ("float8_e4m3fn", 1.6, 3.75))]
    text = table({"meta": meta, "results": cells})
    rows = [ln for ln in text.splitlines() if ln.startswith("| 128 | 64 | 8 | 32768 |")]
    assert rows == ["| 128 | 64 | 8 | 32768 | bfloat16 | 3000.0 | 0.94 (4.00) | 1.000 |",
                    "| 128 | 64 | 8 | 32768 | float8_e4m3fn | 1600.0 | 0.88 (3.75) | 0.533 |"]
