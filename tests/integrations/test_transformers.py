"""The Hugging Face backend (`attncc.integrations.transformers`, docs/integrations.md) on the CPU:
tiny random-initialised Llama, Qwen2 (a sliding-window layer) and Gemma-2 (sliding window and
logit softcap) built from configs in the test, run with attn_implementation="attncc" against
transformers' own "sdpa" (Gemma-2: "eager", as transformers gives Gemma-2 no sdpa), fp32 logits
within 1e-4 on a padded batch and the same greedy tokens from generate(); then the mask forms
the attention function takes, the mask builder's fallback and the clear errors."""
from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attncc.errors import (InvalidArgument, InvalidArgumentType, MissingDependency,  # noqa: E402
                           TraceError)
from attncc.integrations import transformers as hf  # noqa: E402
from attncc.runtime.flex.block_mask import BlockMask  # noqa: E402

VOCAB, SEQ, WINDOW = 128, 12, 5
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
              initializer_range=0.2)  # scores of a few units: softmax far from uniform


def _config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON)
    if arch == "qwen2":  # layer 0 full attention, layer 1 a sliding window shorter than SEQ
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1)
    return transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16,
                                     sliding_window=WINDOW, attn_logit_softcapping=20.0,
                                     final_logit_softcapping=30.0)


BASELINE = {"llama": "sdpa", "qwen2": "sdpa", "gemma2": "eager"}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert hf.register() == "attncc"


def _model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = _config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # every row generates all its tokens
    return model.eval()


def _batch(side: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows: unpadded, padded by 4, padded by 1 (on `side`)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    for row, n in ((1, 4), (2, 1)):
        if side == "left":
            mask[row, :n] = 0
        else:
            mask[row, SEQ - n:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _logits(model, impl: str, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_logits_match_transformers_on_a_padded_batch(arch: str, side: str) -> None:
    model = _model(arch)
    ids, mask = _batch(side)
    ref = _logits(model, BASELINE[arch], ids, mask)
    out = _logits(model, "attncc", ids, mask)
    real = mask.bool()  # padded positions attend to nothing real: their logits are arbitrary
    assert torch.isfinite(out[real]).all()
    assert (out[real] - ref[real]).abs().max().item() <= 1e-4
    if side == "left":  # the padding matters: without it the real positions' logits change
        unpadded = _logits(model, "attncc", ids, None)
        assert (unpadded[real] - ref[real]).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_generate_gives_the_same_greedy_tokens(arch: str) -> None:
    """Left padding (generate's convention); 8 new tokens take Qwen2's and Gemma-2's sliding
    layers past their window, through the cache's decode steps (one query over the cache)."""
    model = _model(arch)
    ids, mask = _batch("left", seed=2)
    outs = {}
    for impl in (BASELINE[arch], "attncc"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                    do_sample=False, pad_token_id=0)
    assert outs["attncc"].shape == (3, SEQ + 8)
    assert torch.equal(outs["attncc"], outs[BASELINE[arch]])


def test_generate_with_a_static_cache() -> None:
    """A static cache: generate() builds each step's mask ahead of the model call (as torch's
    BlockMask class, which transformers takes as a prepared 4-D mask); the keys are the whole
    cache, its unwritten slots masked by the queries' offsets."""
    model = _model("llama")
    ids, mask = _batch("left", seed=3)
    outs = {}
    for impl in ("sdpa", "attncc"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                    do_sample=False, pad_token_id=0,
                                    cache_implementation="static")
    assert torch.equal(outs["attncc"], outs["sdpa"])
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    built = hf.attncc_mask(batch_size=3, q_length=4, kv_length=4, q_offset=0, kv_offset=0,
                           attention_mask=mask[:, :4].bool())
    assert isinstance(built, TorchBlockMask) and len(built.shape) == 4


def test_softcap_is_applied() -> None:
    """Gemma-2 with a small softcap: attncc follows eager, and differs from no softcap."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16,
                                    sliding_window=WINDOW, attn_logit_softcapping=0.5)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.eval()
    ids, mask = _batch("right")
    ref = _logits(model, "eager", ids, mask)
    out = _logits(model, "attncc", ids, mask)
    real = mask.bool()
    assert (out[real] - ref[real]).abs().max().item() <= 1e-4
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    plain = _logits(model, "attncc", ids, mask)
    assert (plain[real] - ref[real]).abs().max().item() > 1e-3


def test_mask_builder_reads_padding_as_a_captured_vector() -> None:
    """The padding enters as a [B, kv] tensor the mask_mod indexes, not as a dense mask, and
    transformers' and_masks are rebuilt from their parts (so the mask stays analytic)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    pad = torch.ones(2, 300, dtype=torch.bool)
    pad[1, :7] = False
    bm = hf.hf_block_mask(batch_size=2, q_length=300, kv_length=300, q_offset=0, kv_offset=0,
                        mask_function=sliding_window_causal_mask_function(64),
                        attention_mask=pad)
    assert isinstance(bm, BlockMask) and bm.classified_by == "analytic"
    shapes = [tuple(t.shape) for t in bm.bindings.tensors.values()]
    assert shapes == [(2, 300)]
    q, kv = torch.arange(300)[:, None], torch.arange(300)[None, :]
    want = (kv <= q) & (kv > q - 64)
    keep = torch.stack([want, want & pad[1][None, :]])
    got = _element_mask(bm, 2, 300, 300)
    assert torch.equal(got, keep)


def _element_mask(bm: BlockMask, B: int, Q: int, KV: int) -> torch.Tensor:
    """The element-level mask a BlockMask means, through flex_attention itself: a key is kept
    where an indicator value of 1 in its slot reaches the output."""
    import attncc

    out = torch.empty(B, Q, KV, dtype=torch.bool)
    q = torch.zeros(B, 1, Q, 1)
    k = torch.zeros(B, 1, KV, 1)
    v = torch.eye(KV).expand(B, 1, KV, KV)
    res = attncc.flex_attention(q, k, v.contiguous(), block_mask=bm)
    out[:] = res[:, 0] > 0
    return out


def test_mask_builder_offsets_and_cache_position_agree() -> None:
    """transformers >= 5.x passes q_offset / kv_offset; 5.0 passed cache_position: both give
    the same mask for a decode-like call (3 queries after 9 cached keys, window 4)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    pad = torch.tensor([[0] * 2 + [1] * 10, [1] * 12])
    fn = sliding_window_causal_mask_function(4)
    by_offset = hf.hf_block_mask(batch_size=2, q_length=3, kv_length=12, q_offset=9,
                                 kv_offset=0, mask_function=fn, attention_mask=pad)
    by_position = hf.hf_block_mask(batch_size=2, kv_length=12,
                                   cache_position=torch.arange(9, 12), mask_function=fn,
                                   attention_mask=pad)
    q, kv = torch.arange(9, 12)[:, None], torch.arange(12)[None, :]
    want = (kv <= q) & (kv > q - 4) & pad.bool()[:, None, :]
    assert torch.equal(_element_mask(by_offset, 2, 3, 12), want)
    assert torch.equal(_element_mask(by_position, 2, 3, 12), want)


def test_untraceable_mask_function_falls_back_to_the_dense_mask(monkeypatch) -> None:
    """When attncc cannot trace a mask function (TraceError), the builder returns
    transformers' dense boolean mask for the same arguments, and attention reads it."""
    from transformers.masking_utils import and_masks, causal_mask_function

    def untraceable(*args, **kwargs):
        raise TraceError("stand-in for a mask function attncc cannot trace")

    def odd_keys(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 1

    monkeypatch.setattr(hf, "create_block_mask", untraceable)
    pad = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    mask = hf.hf_block_mask(batch_size=1, q_length=6, kv_length=8, q_offset=2, kv_offset=0,
                          mask_function=and_masks(causal_mask_function, odd_keys),
                          attention_mask=pad)
    q, kv = torch.arange(2, 8)[:, None], torch.arange(8)[None, :]
    want = (kv <= q) & (kv % 2 == 1) & pad.bool()
    assert mask.dtype == torch.bool and torch.equal(mask[0, 0], want)
    x = torch.randn(1, 2, 8, 4)
    out, _ = hf.attncc_attention(_Layer(), x[:, :, 2:], x, x, mask)
    assert (out - _sdpa(x[:, :, 2:], x, x, want, None)).abs().max().item() <= 1e-5


class _Layer(torch.nn.Module):
    is_causal = True


def _sdpa(q, k, v, mask, scale):
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("form", ["bool", "float", "float_per_head"])
def test_attention_takes_4d_masks(form: str) -> None:
    torch.manual_seed(3)
    B, Hq, Hkv, S, D = 2, 4, 2, 7, 8
    q = torch.randn(B, Hq, S, D)
    k, v = torch.randn(B, Hkv, S + 2, D), torch.randn(B, Hkv, S + 2, D)
    keep = torch.rand(B, 1, S, S + 2) > 0.3
    keep[..., 0] = True  # every row keeps a key
    if form == "bool":
        mask = keep
    else:
        heads = Hq if form == "float_per_head" else 1
        mask = torch.randn(B, heads, S, S + 2).masked_fill(~keep, torch.finfo(torch.float32).min)
    out, weights = hf.attncc_attention(_Layer(), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (B, S, Hq, D)
    assert (out - _sdpa(q, k, v, mask, 0.3)).abs().max().item() <= 1e-5


def test_attention_without_a_mask_follows_sdpa_is_causal() -> None:
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    out, _ = hf.attncc_attention(_Layer(), q, k, v, None)
    assert (out - _sdpa(q, k, v, causal, None)).abs().max().item() <= 1e-5
    full, _ = hf.attncc_attention(_Layer(), q, k, v, None, is_causal=False)
    assert (full - _sdpa(q, k, v, None, None)).abs().max().item() <= 1e-5
    window, _ = hf.attncc_attention(_Layer(), q, k, v, None, sliding_window=3)
    band = causal & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    assert (window - _sdpa(q, k, v, band, None)).abs().max().item() <= 1e-5


def test_bad_calls_raise_clear_errors() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    layer = _Layer()
    with pytest.raises(InvalidArgument, match="dropout"):
        hf.attncc_attention(layer, q, k, v, None, dropout=0.1)
    with pytest.raises(InvalidArgument, match="head_mask"):
        hf.attncc_attention(layer, q, k, v, None, head_mask=torch.zeros(2))
    with pytest.raises(InvalidArgument, match=r"sinks has shape \(3,\)"):
        hf.attncc_attention(layer, q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(InvalidArgument, match="softcap"):
        hf.attncc_attention(layer, q, k, v, None, softcap=0.0)
    with pytest.raises(InvalidArgument, match="4-D mask"):
        hf.attncc_attention(layer, q, k, v, torch.ones(1, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(InvalidArgumentType, match="dtype"):
        hf.attncc_attention(layer, q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.long))
    with pytest.raises(InvalidArgumentType, match="BlockMask or a 4-D tensor"):
        hf.attncc_attention(layer, q, k, v, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(InvalidArgument, match="sliding_window"):  # positions unknown
        hf.attncc_attention(layer, q[:, :, :1], k, v, None, sliding_window=2)
    with pytest.raises(InvalidArgumentType, match="name"):
        hf.register("")


def test_register_without_transformers_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(MissingDependency, match=r"pip install attncc\[hf\]"):
        hf.register()
    assert issubclass(MissingDependency, ImportError)


def test_s_aux_sinks_match_gpt_oss_eager_attention() -> None:
    """gpt-oss passes its per-head sinks as `s_aux`: attncc's result equals transformers' own
    gpt-oss eager attention (the sink as an extra softmax column), GQA and a float mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    layer = _Layer()
    layer.num_key_value_groups = 2
    layer.sinks = torch.nn.Parameter(torch.randn(4, generator=g) * 2)
    mask = torch.zeros(1, 1, 6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(),
                                                float("-inf"))
    want, _ = eager_attention_forward(layer, q, k, v, mask, scaling=8 ** -0.5)
    got, _ = hf.attncc_attention(layer, q, k, v, mask, scaling=8 ** -0.5, s_aux=layer.sinks)
    assert (got - want).abs().max().item() <= 1e-5
    plain, _ = hf.attncc_attention(layer, q, k, v, mask, scaling=8 ** -0.5)
    assert (plain - want).abs().max().item() > 1e-2  # the sinks matter here
