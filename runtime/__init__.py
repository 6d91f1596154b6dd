"""attncc's runtime, in three rooms and a shared oracle:

- `jit/`: NVRTC, the on-disk kernel cache, the driver launcher, TMA tensor maps, device facts,
  the kernel tile configurations, the compile policy (spill report, FA3 low-pressure retry),
  launch-argument pieces, and `attncc.compile` / `export`.
- `flex/`: the FlexAttention-style API, block masks, tile choice, dispatch and launch, the FA3
  split tail and the transform pre-pass.
- `serving/`: `BatchAttention`, the FA3 batch kernel, cascade and merge; `serving/plan/` holds
  the plan format, the batch argument checks, LPT, the scheduler and the C planner.
- `reference.py`: the exact fp64 oracle both flex and serving are tested against.

Serving never imports flex; both import jit and the reference (tests/project/test_layering.py).
"""
