"""FlexAttention code with its import swapped for attncc's runs and agrees with torch.

The user's side of each test is written as FlexAttention programs are: `from attncc import ...`
where they would write `from torch.nn.attention.flex_attention import ...`. torch's own module
(`torch_flex`) is the oracle, run eagerly on the CPU; its one-time compile is skipped with
torch's documented debug switch, which runs the same math without Dynamo.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from attncc import (AuxOutput, AuxRequest, BlockMask, and_masks, create_block_mask, create_mask,
                    flex_attention, noop_mask, or_masks)
from attncc.runtime.flex import torch_compat

B, H, S, D = 2, 4, 300, 16
WINDOW = 96


@pytest.fixture(autouse=True)
def _eager_torch_flex(monkeypatch):
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        warnings.filterwarnings("ignore", message="return_lse is deprecated")  # torch's, 2.13
        yield


def _qkv(seed: int, Hq: int = H, Hkv: int = H, Sq: int = S, Skv: int = S):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Sq, D, generator=g), torch.randn(B, Hkv, Skv, D, generator=g),
            torch.randn(B, Hkv, Skv, D, generator=g))


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


# the user's mods, written as for torch
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < WINDOW


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < 40


DOC = torch.tensor([[0] * 70 + [1] * 130 + [2] * 100, [0] * 150 + [1] * 150])


def same_document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
BIAS = torch.randn(H, 2 * S - 1, generator=torch.Generator().manual_seed(7))


def softcap(score, b, h, q_idx, kv_idx):
    return 20 * torch.tanh(score / 20)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + S - 1]


def causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


SCORE_MODS = [None, softcap, alibi, relative_bias, causal_score]
MASK_MODS = {
    "causal": causal,
    "sliding": and_masks(causal, sliding_window),
    "prefix_lm": or_masks(prefix, causal),
    "document": and_masks(same_document, causal),
    "noop": noop_mask,
}
TORCH_MASK_MODS = {  # the same masks built with torch's helpers, for torch's create_block_mask
    "causal": causal,
    "sliding": torch_flex.and_masks(causal, sliding_window),
    "prefix_lm": torch_flex.or_masks(prefix, causal),
    "document": torch_flex.and_masks(same_document, causal),
    "noop": torch_flex.noop_mask,
}
LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
         "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _same_lists(ours: BlockMask, theirs) -> None:
    for name in LISTS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == torch.int32 and torch.equal(a, b), name
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    assert ours.shape == theirs.shape and ours.numel() == theirs.numel()
    assert ours.sparsity() == pytest.approx(theirs.sparsity())


@pytest.mark.parametrize("score_mod", SCORE_MODS, ids=lambda f: getattr(f, "__name__", "none"))
def test_score_mods_match_torch(score_mod):
    q, k, v = _qkv(1)
    _close(flex_attention(q, k, v, score_mod=score_mod),
           torch_flex.flex_attention(q, k, v, score_mod=score_mod))


@pytest.mark.parametrize("name", MASK_MODS)
@pytest.mark.parametrize("BLOCK_SIZE", [128, (64, 32)], ids=["128", "64x32"])
def test_block_masks_and_outputs_match_torch(name, BLOCK_SIZE):
    ours = create_block_mask(MASK_MODS[name], B, None, S, S, BLOCK_SIZE=BLOCK_SIZE)
    theirs = torch_flex.create_block_mask(TORCH_MASK_MODS[name], B, None, S, S, device="cpu",
                                          BLOCK_SIZE=BLOCK_SIZE)
    _same_lists(ours, theirs)
    assert torch.equal(ours.to_dense(), theirs.to_dense().to(torch.int32))
    q, k, v = _qkv(2)
    _close(flex_attention(q, k, v, score_mod=softcap, block_mask=ours),
           torch_flex.flex_attention(q, k, v, score_mod=softcap, block_mask=theirs))


def test_block_masks_cross_over_both_ways():
    """An attncc BlockMask runs in torch's flex_attention, a torch BlockMask in attncc's."""
    ours = create_block_mask(MASK_MODS["document"], B, H, S, S)
    # attncc's and_masks serve torch too (torch's own are traced by attncc once they use only
    # traceable ops: see attncc.frontend)
    theirs = torch_flex.create_block_mask(MASK_MODS["document"], B, H, S, S, device="cpu")
    q, k, v = _qkv(3)
    want = torch_flex.flex_attention(q, k, v, score_mod=alibi, block_mask=theirs)
    _close(torch_flex.flex_attention(q, k, v, score_mod=alibi, block_mask=ours), want)
    _close(flex_attention(q, k, v, score_mod=alibi, block_mask=theirs), want)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(ours.as_tuple()[:-1], theirs.as_tuple()[:-1]))


def test_gqa_scale_and_lse_match_torch():
    q, k, v = _qkv(4, Hq=H, Hkv=2)
    bm = create_block_mask(causal, None, None, S, S)
    out, lse = flex_attention(q, k, v, score_mod=softcap, block_mask=bm, scale=0.3,
                              enable_gqa=True, return_lse=True)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=softcap, block_mask=bm.to_torch(),
                                             scale=0.3, enable_gqa=True, return_lse=True)
    _close(out, t_out)
    _close(lse, t_lse)


def test_different_query_and_key_lengths_match_torch():
    q, k, v = _qkv(5, Sq=200, Skv=333)

    def bottom_right_causal(b, h, q_idx, kv_idx):
        return q_idx + (333 - 200) >= kv_idx

    ours = create_block_mask(bottom_right_causal, None, None, 200, 333, BLOCK_SIZE=64)
    theirs = torch_flex.create_block_mask(bottom_right_causal, None, None, 200, 333,
                                          device="cpu", BLOCK_SIZE=64)
    _same_lists(ours, theirs)
    _close(flex_attention(q, k, v, block_mask=ours),
           torch_flex.flex_attention(q, k, v, block_mask=theirs))


@pytest.mark.parametrize("name", ["causal", "sliding", "document", "noop"])
def test_create_mask_matches_torch(name):
    ours = create_mask(MASK_MODS[name], B, H, 90, 77)
    theirs = torch_flex.create_mask(TORCH_MASK_MODS[name], B, H, 90, 77, device="cpu")
    assert ours.dtype == torch.bool and ours.shape == (B, H, 90, 77)
    assert torch.equal(ours, theirs.expand(B, H, 90, 77))


def test_create_mask_of_a_score_mod_matches_torch():
    ours = create_mask(causal_score, 1, 2, 50, 60)
    assert torch.equal(ours, torch_flex.create_mask(causal_score, 1, 2, 50, 60, device="cpu"))
    assert torch.equal(create_mask(softcap, 1, 1, 4, 4), torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_create_mask_rejects_what_is_not_a_mod():
    with pytest.raises(TypeError, match="takes 3 arguments"):
        create_mask(lambda b, q, kv: q >= kv, 1, 1, 4, 4)
    with pytest.raises(TypeError, match="mask_mod"):
        create_mask("causal", 1, 1, 4, 4)


@pytest.mark.parametrize("index", [0, -1, (slice(None), 1), (0, slice(1, 3), slice(None, 2)),
                                   (slice(None), slice(None), torch.tensor([2, 0])),
                                   (1, 2, 1)],
                         ids=["b0", "b-1", "h1", "b0_h13_q2", "q_tensor", "b1h2q1"])
def test_slicing_matches_torch(index):
    ours = create_block_mask(MASK_MODS["sliding"], B, H, S, S, BLOCK_SIZE=64)
    theirs = torch_flex.create_block_mask(TORCH_MASK_MODS["sliding"], B, H, S, S, device="cpu",
                                          BLOCK_SIZE=64)
    _same_lists(ours[index], theirs[index])


def test_a_sliced_mask_is_refused_by_both_flex_attentions():
    sliced = create_block_mask(causal, B, H, S, S)[0]
    q, k, v = (t[:1] for t in _qkv(6))
    with pytest.raises(ValueError, match="sliced"):
        flex_attention(q, k, v, block_mask=sliced)
    with pytest.raises(RuntimeError, match="sliced"):
        torch_flex.flex_attention(q, k, v, block_mask=sliced)


def test_adjust_crops_like_torch_and_runs():
    ours = create_block_mask(causal, B, None, 1024, 1024)._adjust(300, 517)
    theirs = torch_flex.create_block_mask(causal, B, None, 1024, 1024, device="cpu")
    theirs = theirs._adjust(300, 517)
    assert ours.shape == theirs.shape == (B, 1, 300, 517)
    assert torch.equal(ours.to_dense(), theirs.to_dense().to(torch.int32))
    # ... and is the mask create_block_mask builds at the new lengths (edge blocks PARTIAL)
    _same_lists(ours, create_block_mask(causal, B, None, 300, 517))
    q, k, v = _qkv(7, Sq=300, Skv=517)
    _close(flex_attention(q, k, v, block_mask=ours),
           torch_flex.flex_attention(q, k, v, block_mask=theirs))


def test_adjust_of_a_window_is_the_mask_built_at_the_new_lengths():
    """A sliding window's rows keep kv blocks that do not start at 0; the crop keeps exactly the
    blocks inside the new lengths, as a mask built at those lengths does."""
    adjusted = create_block_mask(MASK_MODS["sliding"], None, None, 1024, 1024)._adjust(600, 600)
    _same_lists(adjusted, create_block_mask(MASK_MODS["sliding"], None, None, 600, 600))
    with pytest.raises(ValueError, match="only crops"):
        adjusted._adjust(700, 600)


def test_create_block_mask_takes_torchs_keywords():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: attncc never compiles the mask
        compiled = create_block_mask(causal, B, H, S, S, _compile=True)
    _same_lists(compiled, create_block_mask(causal, B, H, S, S))
    ours = create_block_mask(causal, B, H, S, S, separate_full_blocks=False)
    theirs = torch_flex.create_block_mask(causal, B, H, S, S, device="cpu",
                                          separate_full_blocks=False)
    _same_lists(ours, theirs)
    q, k, v = _qkv(8)
    _close(flex_attention(q, k, v, block_mask=ours),
           torch_flex.flex_attention(q, k, v, block_mask=theirs))


def test_from_kv_blocks_like_torch():
    theirs = torch_flex.create_block_mask(causal, 1, 2, 512, 384, device="cpu", BLOCK_SIZE=64)
    ours = BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices,
                                    theirs.full_kv_num_blocks, theirs.full_kv_indices,
                                    BLOCK_SIZE=64, mask_mod=causal, seq_lengths=(512, 384))
    _same_lists(ours, theirs)
    bare = BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices,
                                    compute_q_blocks=False)
    assert bare.q_indices is None and bare.full_kv_indices is None
    assert bare.mask_mod is noop_mask and bare.BLOCK_SIZE == (128, 128)
    assert bare.shape == (1, 2, 8 * 128, 6 * 128)


def test_shape_numel_sparsity_str_and_device():
    bm = create_block_mask(causal, B, H, 1000, 1000)
    theirs = torch_flex.create_block_mask(causal, B, H, 1000, 1000, device="cpu")
    assert bm.shape == theirs.shape == (B, H, 1000, 1000)
    assert bm.numel() == theirs.numel() and bm.sparsity() == pytest.approx(theirs.sparsity())
    text = str(bm)
    assert text.startswith(f"BlockMask(shape=(2, 4, 1000, 1000), sparsity={bm.sparsity():.2f}%")
    assert text.count("(0, ") == 4 and "(1, 0)" not in text and "limit=N" in text
    picture = bm[0, 0].to_string(grid_size=-1).splitlines()
    assert picture[0] == "(0, 0)" and len(picture) == 1 + 8  # one line per query block
    assert picture[1:3] == ["░░", "██░░"] and picture[-1] == "░░" * 8  # 1000 rows: ragged
    assert set("".join(picture[1:])) <= {"█", "░", " "}
    assert len(bm.to_string(grid_size=2, limit=1).splitlines()) == 1 + 2 + 1 + 1
    moved = bm.to(torch.device("cpu"))
    _same_lists(moved, theirs)
    assert moved.kv_indices.device.type == "cpu" and moved.mask_mod is causal


def test_return_aux_gives_torchs_aux_output():
    q, k, v = _qkv(9)
    bm = create_block_mask(causal, None, None, S, S)
    out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                              return_aux=AuxRequest(lse=True))
    assert isinstance(aux, AuxOutput) and aux.max_scores is None
    if hasattr(torch_flex, "AuxRequest"):  # torch >= 2.13: its request gets its AuxOutput
        t_out, t_aux = torch_flex.flex_attention(q, k, v, score_mod=alibi,
                                                 block_mask=bm.to_torch(),
                                                 return_aux=torch_flex.AuxRequest(lse=True))
        _close(out, t_out)
        _close(aux.lse, t_aux.lse)
        _, ours_for_torch = flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                                           return_aux=torch_flex.AuxRequest(lse=True))
        assert isinstance(ours_for_torch, torch_flex.AuxOutput)
        torch.testing.assert_close(ours_for_torch.lse, aux.lse, rtol=0, atol=0)
    _close(aux.lse, flex_attention(q, k, v, score_mod=alibi, block_mask=bm, return_lse=True)[1])
    out2, empty = flex_attention(q, k, v, return_aux=AuxRequest())
    assert empty == AuxOutput(None, None) and out2.shape == out.shape
    with pytest.raises(ValueError, match="not both"):
        flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match="AuxRequest"):
        flex_attention(q, k, v, return_aux=True)


def test_max_scores_is_the_row_max_of_kept_modified_scores():
    """torch's CPU path cannot return max_scores; the definition is checked directly: the max
    over kept keys of score_mod(scale * q.k), -inf on a fully masked row."""
    q, k, v = _qkv(10)

    def late(b, h, q_idx, kv_idx):  # rows before 5 keep nothing
        return (q_idx >= kv_idx) & (q_idx >= 5)

    bm = create_block_mask(late, None, None, S, S)
    _, aux = flex_attention(q, k, v, score_mod=softcap, block_mask=bm,
                            return_aux=AuxRequest(lse=True, max_scores=True))
    s = 20 * torch.tanh((q.double() @ k.double().transpose(-1, -2)) / D ** 0.5 / 20)
    keep = create_mask(late, None, None, S, S)
    want = s.masked_fill(~keep, -float("inf")).amax(-1).float()
    assert aux.max_scores.dtype == torch.float32
    torch.testing.assert_close(aux.max_scores, want)
    assert torch.isneginf(aux.max_scores[..., :5]).all() and torch.isneginf(aux.lse[..., :5]).all()
    assert (aux.max_scores[..., 5:] <= aux.lse[..., 5:]).all()  # max <= logsumexp


def test_torchs_kernel_options_are_accepted_and_named_once(monkeypatch):
    monkeypatch.setattr(torch_compat, "_warned", set())
    q, k, v = _qkv(11)
    want = flex_attention(q, k, v, score_mod=softcap)
    opts = {"PRESCALE_QK": True, "BACKEND": "TRITON", "USE_TMA": True, "WRITE_DQ": False,
            "ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": False, "num_stages": 2,
            "num_warps": 4, "BLOCK_M": 64, "BLOCK_N": 64, "fwd_BLOCK_M": 32,
            "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64}
    with pytest.warns(UserWarning, match="ignores torch's kernel_options") as seen:
        out = flex_attention(q, k, v, score_mod=softcap, kernel_options=opts)
    assert len(seen) == 1
    for name in ("PRESCALE_QK", "BACKEND", "USE_TMA", "WRITE_DQ", "bwd_BLOCK_M1"):
        assert name in str(seen[0].message)
    assert torch.equal(out, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per key: the second call is quiet
        flex_attention(q, k, v, score_mod=softcap, kernel_options=opts)
        flex_attention(q, k, v, kernel_options={"BACKEND": "AUTO", "fwd_num_warps": 8})
    # the forward's tile keys are honoured: fwd_ wins over the plain key, as in torch
    assert torch_compat.forward_kernel_options(opts, {"BLOCK_M", "BLOCK_N", "num_stages",
                                                      "num_warps", "ROWS_GUARANTEED_SAFE",
                                                      "BLOCKS_ARE_CONTIGUOUS"}) == {
        "ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": False, "num_stages": 2,
        "num_warps": 4, "BLOCK_M": 32, "BLOCK_N": 64}


@pytest.mark.parametrize("opts,match", [
    ({"NOT_A_KEY": 1}, "not supported"),
    ({"fwd_NOT_A_KEY": 1}, "not supported"),
    ({"BACKEND": "CUDNN"}, "torch's backends"),
    ({"BACKEND": "FLASH", "FORCE_USE_FLEX_ATTENTION": True}, "cannot be combined"),
    ({"OUTPUT_MAX": True}, "internal to torch"),
    ({"PRESCALE_QK": 1}, "True or False"),
])
def test_bad_kernel_options_still_raise(opts, match):
    q, k, v = _qkv(12)
    with pytest.raises(ValueError, match=match):
        flex_attention(q, k, v, kernel_options=opts)


def test_torchs_constructor_order_is_a_clear_error():
    theirs = torch_flex.create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    with pytest.raises(TypeError, match="from_kv_blocks"):
        BlockMask(theirs.seq_lengths, theirs.kv_num_blocks, theirs.kv_indices, None, None,
                  None, None, None, None, (128, 128), causal, (256, 256))


def test_attncc_mask_helpers_serve_torchs_create_block_mask_too():
    for ours, theirs in ((and_masks(causal, sliding_window),
                          torch_flex.and_masks(causal, sliding_window)),
                         (or_masks(prefix, causal), torch_flex.or_masks(prefix, causal))):
        _same_lists(torch_flex.create_block_mask(ours, B, 1, S, S, device="cpu"),
                    torch_flex.create_block_mask(theirs, B, 1, S, S, device="cpu"))
        _same_lists(create_block_mask(ours, B, 1, S, S),
                    torch_flex.create_block_mask(theirs, B, 1, S, S, device="cpu"))
