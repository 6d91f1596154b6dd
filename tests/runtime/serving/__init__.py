"""Tests of attncc.runtime.serving: BatchAttention, cascade, merge."""
