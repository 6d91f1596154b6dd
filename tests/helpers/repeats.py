"""A helper for the GPU tests of run-to-run determinism: a launch repeated eagerly and replayed
from a CUDA graph must rewrite its poisoned outputs with bitwise the same values."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def assert_repeats_bitwise(step: Callable[[], None], outputs: Sequence[torch.Tensor],
                           expected: Sequence[torch.Tensor], times: int = 3) -> None:
    """Run `step` `times` times eagerly, then capture it in a CUDA graph and replay it `times`
    times; before each run every output is poisoned with NaN, after it each must equal its
    `expected` bitwise.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     x = torch.zeros(4, device="cuda")
        ...     assert_repeats_bitwise(lambda: x.copy_(torch.ones(4, device="cuda")), [x],
        ...                            [torch.ones(4, device="cuda")])
    """
    def check(run: Callable[[], None]) -> None:
        for _ in range(times):
            for out in outputs:
                out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            for out, want in zip(outputs, expected):
                assert torch.equal(out, want)

    check(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the default stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    check(graph.replay)
