"""Benchmarks (GPU; `--report` on the CPU). A package so that its modules share `bench.timing` and
`bench.prefill`'s report helpers and the tests can import them: run one from the repository root
as `python -m bench.prefill`, which also imports this checkout's attncc (DEVELOPERS.md, "Scripts
and benchmarks")."""
