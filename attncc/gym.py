"""The AttentionGym variants as attncc mods: plain Python that torch's FlexAttention can run too.

Mask mods are `mask_mod(b, h, q_idx, kv_idx) -> bool`, score mods
`score_mod(score, b, h, q_idx, kv_idx) -> score`; factories (`sliding_window(256)`,
`alibi(H)`, ...) return a mod that captures its parameters, so attncc compiles the parameter as a
kernel argument and a new value never recompiles. `sigmoid_attention` and `rope` need hooks
FlexAttention lacks and return an `attncc.Variant`.

`GYM` maps a name to a factory `make(B, H, S, D, seed=0) -> Variant` building that variant for
a B x H x S x S problem with head dim D (tests and benchmarks iterate over it).

Example:
    >>> import torch, attncc
    >>> q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    >>> out = attncc.flex_attention(q, k, v, score_mod=GYM["softcap_causal"](1, 2, 64, 16))
    >>> out.shape
    torch.Size([1, 2, 64, 16])
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .frontend import Variant, and_masks, or_masks

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]


# ------------------------------------------------------------------------------------ masks
def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Causal mask: query i sees keys 0..i.

    Example:
        >>> bool(causal(0, 0, torch.tensor(3), torch.tensor(2)))
        True
    """
    return q_idx >= kv_idx


_causal = causal  # document_mask's `causal` flag shadows the function's name


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window (AttentionGym's convention): query i sees keys i-window .. i.

    Example:
        >>> m = sliding_window(2)
        >>> [bool(m(0, 0, torch.tensor(5), torch.tensor(k))) for k in range(7)]
        [False, False, False, True, True, True, False]
    """
    def sliding_window_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return sliding_window_causal


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix LM: every query sees the first `prefix_len` keys, and the rest causally.

    Example:
        >>> m = prefix_lm(4)
        >>> bool(m(0, 0, torch.tensor(1), torch.tensor(3))), bool(m(0, 0, torch.tensor(5), torch.tensor(6)))
        (True, False)
    """
    def prefix(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < prefix_len

    return or_masks(prefix, causal)


def document_mask(doc_ids: torch.Tensor, causal: bool = False) -> MaskMod:
    """Packed sequences: a query sees only keys of its own document (`doc_ids` is [B, S] int).

    With `causal=True` it also sees only earlier keys (AttentionGym's document_causal). Queries
    and keys index the same packed sequence, so Q_LEN == KV_LEN == S.

    Example:
        >>> ids = torch.tensor([[0, 0, 1, 1, 1]])
        >>> m = document_mask(ids)
        >>> bool(m(0, 0, torch.tensor(1), torch.tensor(0))), bool(m(0, 0, torch.tensor(2), torch.tensor(1)))
        (True, False)
    """
    def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    if causal:
        return and_masks(same_document, _causal)
    return same_document


# ------------------------------------------------------------------------------- score mods
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes 2^(-8(h+1)/H), float32 [H].

    Example:
        >>> alibi_slopes(2).tolist()
        [0.0625, 0.00390625]
    """
    return torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads
                      ).float()


def alibi(num_heads: int) -> ScoreMod:
    """ALiBi: add slope[h] * (kv_idx - q_idx), a linear penalty on distance (slopes captured).

    Example:
        >>> m = alibi(2)
        >>> float(m(torch.tensor(1.0), 0, 0, torch.tensor(4), torch.tensor(0)))
        0.75
    """
    slopes = alibi_slopes(num_heads)

    def alibi_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_bias


def softcap(cap: float = 30.0) -> ScoreMod:
    """Logit soft-capping (Gemma 2, Grok): cap * tanh(score / cap); `cap` is a kernel scalar.

    Example:
        >>> round(float(softcap(30.0)(torch.tensor(1000.0), 0, 0, 0, 0)), 4)
        30.0
    """
    def tanh_softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return tanh_softcap


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """T5-style learned relative position bias: table[h, clamp(q - kv, -128, 127) + 128].

    `table` is [H, 256] (captured); distances beyond +-128 share the edge buckets.

    Example:
        >>> t = torch.arange(256.0).repeat(2, 1)
        >>> float(relative_bias(t)(torch.tensor(0.0), 0, 1, torch.tensor(3), torch.tensor(1)))
        130.0
    """
    def rel_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + table[h, torch.clamp(q_idx - kv_idx, -128, 127) + 128]

    return rel_bias


# ------------------------------------------------------------------ variants beyond FlexAttention
def sigmoid_attention(bias: float) -> Variant:
    """Sigmoid attention (Ramapuram et al. 2024): out = sum_kv sigmoid(score + bias) * v.

    No softmax (`normalize="none"`); the paper uses bias = -log(seq_len). `bias` is a kernel
    scalar.

    Example:
        >>> v = sigmoid_attention(-math.log(128))
        >>> v.normalize
        'none'
    """
    def sigmoid_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.sigmoid(score + bias)

    return Variant(score_mod=sigmoid_score, normalize="none", name="sigmoid_attention")


def rope(head_dim: int, interleaved: bool = False, base: float = 10000.0) -> Variant:
    """Rotary position embedding applied inside attention, as query_mod and key_mod.

    Pair (i, i + D/2) (GPT-NeoX "half-rotated" layout) or (2i, 2i+1) (`interleaved=True`, GPT-J
    layout) is rotated by the angle pos * base^(-2i/D), pos = q_idx for queries and kv_idx for
    keys. `head_dim` must equal the query/key head dim D (even).

    Example:
        >>> ir, _ = rope(8).trace()
        >>> sorted(ir.hooks)
        ['key_mod', 'query_mod']
    """
    if head_dim % 2:
        raise ValueError(f"rope(head_dim={head_dim}): RoPE rotates pairs, use an even head dim")
    D = head_dim
    half = D // 2
    neg_log_base = -math.log(base)

    def rotate(x: Any, pos: Any, d: Any) -> Any:
        if interleaved:
            i = d // 2
            partner = d + 1 - 2 * (d % 2)          # 2i <-> 2i+1
            sign = 2 * (d % 2) - 1                 # even slot: -partner, odd slot: +partner
        else:
            i = d % half
            partner = (d + half) % D               # i <-> i + D/2
            sign = torch.where(d < half, -1, 1)    # first half: -partner, second half: +partner
        theta = pos * torch.exp(neg_log_base * (2 * i) / D)
        return x[d] * torch.cos(theta) + sign * x[partner] * torch.sin(theta)

    def rope_query(q: Any, b: Any, h: Any, q_idx: Any, d: Any) -> Any:
        return rotate(q, q_idx, d)

    def rope_key(k: Any, b: Any, h: Any, kv_idx: Any, d: Any) -> Any:
        return rotate(k, kv_idx, d)

    return Variant(query_mod=rope_query, key_mod=rope_key,
                   name="rope_interleaved" if interleaved else "rope")


# ------------------------------------------------------------------------------------ GYM
def _doc_ids(B: int, S: int, seed: int) -> torch.Tensor:
    """[B, S] int32 document ids: about four documents of random lengths per sequence."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, S, generator=g) < 4.0 / max(S, 1)
    starts[:, 0] = False
    return torch.cumsum(starts.int(), -1).int()


def _relative_table(H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, 256, generator=g)


GymFactory = Callable[..., Variant]

GYM: dict[str, GymFactory] = {
    "noop": lambda B, H, S, D, seed=0: Variant(name="noop"),
    "causal": lambda B, H, S, D, seed=0: Variant(mask_mod=causal, name="causal"),
    "sliding_window": lambda B, H, S, D, seed=0: Variant(
        mask_mod=sliding_window(max(1, S // 4)), name="sliding_window"),
    "prefix_lm": lambda B, H, S, D, seed=0: Variant(
        mask_mod=prefix_lm(max(1, S // 4)), name="prefix_lm"),
    "document_mask": lambda B, H, S, D, seed=0: Variant(
        mask_mod=document_mask(_doc_ids(B, S, seed)), name="document_mask"),
    "document_causal": lambda B, H, S, D, seed=0: Variant(
        mask_mod=document_mask(_doc_ids(B, S, seed), causal=True), name="document_causal"),
    "alibi": lambda B, H, S, D, seed=0: Variant(score_mod=alibi(H), name="alibi"),
    "alibi_causal": lambda B, H, S, D, seed=0: Variant(
        score_mod=alibi(H), mask_mod=causal, name="alibi_causal"),
    "softcap": lambda B, H, S, D, seed=0: Variant(score_mod=softcap(30.0), name="softcap"),
    "softcap_causal": lambda B, H, S, D, seed=0: Variant(
        score_mod=softcap(30.0), mask_mod=causal, name="softcap_causal"),
    "relative_bias": lambda B, H, S, D, seed=0: Variant(
        score_mod=relative_bias(_relative_table(H, seed)), name="relative_bias"),
    "sigmoid": lambda B, H, S, D, seed=0: sigmoid_attention(-math.log(max(S, 2))),
    "rope": lambda B, H, S, D, seed=0: rope(D),
    "rope_interleaved": lambda B, H, S, D, seed=0: rope(D, interleaved=True),
}
"""name -> make(B, H, S, D, seed=0) -> Variant, for a B x H x S x S problem with head dim D."""

# Ready-made variants, e.g. for `attncc compile attncc.gym:softcap_causal`.
softcap_causal = Variant(score_mod=softcap(30.0), mask_mod=causal, name="softcap_causal")
sliding_window_causal = Variant(mask_mod=sliding_window(1024), name="sliding_window_1024")
