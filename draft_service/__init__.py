"""The draft service: a small model proposing tokens for the verify service."""
