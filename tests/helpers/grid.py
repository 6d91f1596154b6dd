"""The broadcast grid a traced score_mod/mask_mod is evaluated on (frontend and IR tests)."""
from __future__ import annotations

import torch


def score_grid(B: int, H: int, Q: int, K: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The broadcast grid a traced score_mod/mask_mod is evaluated on: a random fp64 score
    [B, H, Q, K] and the index tensors b, h, q_idx, kv_idx shaped to broadcast against it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "score": torch.randn(B, H, Q, K, generator=g, dtype=torch.float64) * 3,
        "b": torch.arange(B).view(B, 1, 1, 1),
        "h": torch.arange(H).view(1, H, 1, 1),
        "q_idx": torch.arange(Q).view(1, 1, Q, 1),
        "kv_idx": torch.arange(K).view(1, 1, 1, K),
    }
