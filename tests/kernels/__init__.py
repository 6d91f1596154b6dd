"""Tests of the kernel building blocks in kernels/ (attncc.kernels) that need no GPU."""
