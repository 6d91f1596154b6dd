"""Facts about the CUDA device a launch plans for (the compile target's arch is
`nvrtc.device_arch`).

Example (planning on the CPU assumes an H100/H200):
    >>> import torch
    >>> num_sms(torch.device("cpu"))
    132
"""
from __future__ import annotations

import functools

import torch

__all__ = ["capability", "num_sms"]


@functools.lru_cache(maxsize=None)
def num_sms(device: int | torch.device) -> int:
    """SMs of a CUDA device (index or torch.device); planning on the CPU (no GPU) assumes an
    H100/H200's 132."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `device`, asked of torch once."""
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]
