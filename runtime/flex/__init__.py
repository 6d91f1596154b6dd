"""The FlexAttention-style path: API, block masks, tile choice, dispatch and launch, split
tail and pre-pass."""
