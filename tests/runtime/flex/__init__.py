"""Tests of attncc.runtime.flex: the FlexAttention-style API, block masks, tiles, split tail."""
