"""Tests of attncc.runtime (CPU and NVRTC): the reference, argument checks, and one folder per room."""
