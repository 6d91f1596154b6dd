"""scripts/ab_kernels.py's arguments (the A/B itself needs a GPU)."""
from __future__ import annotations

import sys

import pytest

from scripts import ab_kernels


@pytest.mark.parametrize("argv,message", [
    (["/tmp", "--variants", "relbias_causal"], "add --backward"),
    (["/tmp", "--backward", "--D", "64"], "head dim 128"),
])
def test_bad_combinations_are_refused_before_any_run(argv: list[str], message: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["ab_kernels.py", *argv])
    monkeypatch.setattr(ab_kernels, "compare", lambda *a: pytest.fail("ran"))
    monkeypatch.setattr(ab_kernels, "compare_backward", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        ab_kernels.main()
    assert message in capsys.readouterr().err


def test_backward_flag_picks_the_backward_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    monkeypatch.setattr(sys, "argv", ["ab_kernels.py", "/tmp/rev/kernels", "--backward",
                                      "--variants", "alibi_learned_causal", "--S", "8192"])
    monkeypatch.setattr(ab_kernels, "template_switch", lambda: (lambda folder: None))
    monkeypatch.setattr(ab_kernels, "compare_backward",
                        lambda builds, S, variants, rounds: seen.append((
                            [b[0] for b in builds], S, variants)))
    ab_kernels.main()
    assert seen == [(["current", "rev"], [8192], ["alibi_learned_causal"])]


def test_interleaved_reports_best_rounds_and_output_differences() -> None:
    """Builds run in interleaved rounds, each under its own setup; the best TFLOP/s and the
    last round's outputs are compared with the first build's, whose setup runs last."""
    import torch

    installed: list[str] = []
    speeds = {"a": iter([100.0, 120.0]), "b": iter([150.0, 90.0])}
    outs = {"a": [torch.zeros(3)], "b": [torch.tensor([0.0, 0.5, 0.0])]}

    def run(opts: dict | None) -> tuple[float, list]:
        return next(speeds[installed[-1]]), outs[installed[-1]]

    builds = [(n, lambda n=n: installed.append(n), None) for n in ("a", "b")]
    line = ab_kernels._interleaved(builds, 2, run)
    assert installed == ["a", "b", "a", "b", "a"]
    assert line == "a  120.0  b  150.0 (a/b 0.800, max|diff| 5.0e-01)"
