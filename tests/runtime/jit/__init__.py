"""Tests of attncc.runtime.jit: NVRTC, the kernel cache, compile/export, spill policy."""
