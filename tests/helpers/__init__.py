"""Helpers shared by several test modules, imported as `tests.helpers.<module>` (pytest puts the
repository root on sys.path because `tests/` is a package).

- `ROOT`: the repository root, for tests that read docs, kernels, bench or scripts files.
- `grid.score_grid`: the broadcast grid a traced mod is evaluated on.
- `discrete_exprs`: random mods whose float arithmetic becomes integers.
- `trees`: speculative-decoding tree masks in FlashInfer's layouts (multi-token decode).
- `fa3_launch.run_fa3`, `repeats.assert_repeats_bitwise`: FA3 launch forms and determinism (GPU).
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
