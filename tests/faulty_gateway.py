"""Runs the gateway with a bug injected: tokenizing a text prompt that starts with
FAULT_TEXT raises, for the test that proves no exception's text reaches a client.

    python tests/faulty_gateway.py <the gateway's own flags>
"""

from __future__ import annotations

import sys

import grpc

from gateway import server
from gateway.tokenizing import PromptTokenizer

FAULT_TEXT = "tokenizer bug: this text must never reach a client"

_encode = PromptTokenizer.encode


def faulty_encode(self: PromptTokenizer, text: str, context: grpc.ServicerContext) -> list[int]:
    if text.startswith(FAULT_TEXT):
        raise RuntimeError(FAULT_TEXT)
    return _encode(self, text, context)


if __name__ == "__main__":
    PromptTokenizer.encode = faulty_encode
    sys.exit(server.main())
