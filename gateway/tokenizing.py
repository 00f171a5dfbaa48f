"""Tokenization of text prompts on a few threads of its own.

Tokenizing is the gateway's one CPU-heavy step per request. On the gRPC handler threads
(one per call, dozens) many long prompts at once would take every core from the streams
being served; on a small pool they wait their turn instead, and a handler only waits.
"""

from __future__ import annotations

from concurrent.futures import CancelledError, ThreadPoolExecutor

import grpc
from transformers import PreTrainedTokenizerBase

from specdec.errors import Cancelled


class PromptTokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, workers: int) -> None:
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")

    def encode(self, text: str, context: grpc.ServicerContext) -> list[int]:
        """The token ids of text. A call that ends (client gone, deadline passed) while
        its prompt waits for a thread is taken out of the queue and raises Cancelled."""
        future = self._pool.submit(self._tokenizer.encode, text)
        if not context.add_callback(future.cancel):  # the call has already ended
            future.cancel()
        try:
            return future.result()
        except CancelledError:
            raise Cancelled("the call ended before its prompt was tokenized") from None

    def shutdown(self) -> None:
        self._pool.shutdown(cancel_futures=True)
