"""Serving: BatchAttention, the FA3 batch kernel, cascade and attention-state merge."""
