"""Tests of attncc.codegen: generated CUDA source and its semantics."""
