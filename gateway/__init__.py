"""The gateway: the public Generation API, tokenization, text deltas and stop sequences."""
