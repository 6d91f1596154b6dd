"""Workflow tools: the GPU check (`gpu_check.sh`), the kernel hash list (`kernel_hashes.py`), the
FA3 resource report (`fa3_resources.py`), the compute-sanitizer cases (`fa3_sanitize_case.py`,
`fa2_backward_sanitize_case.py`, `fa2_decode_sanitize_case.py`)
and the A/B of git revisions' kernels (`ab_kernels.py`); one-off measurements live in
`scripts/experiments/`. Run them from the repository root as `python -m scripts.kernel_hashes`,
which imports this checkout's attncc and `bench` (DEVELOPERS.md, "Scripts and benchmarks")."""
