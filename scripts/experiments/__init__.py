"""Experiments: measurements and probes kept for re-running, not part of the workflow (the FA3
macro/kernel_options timer, in-process A/B of kernel file revisions, the decode profiler, the
wgmma descriptor probe). Run as `python -m scripts.experiments.<name>` from the root."""
