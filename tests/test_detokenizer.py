"""Streaming text: no half characters, nothing lost; stop sequences never leak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stops import StopMatcher


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy.target)


def stream(tokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def test_a_character_split_over_tokens_is_released_whole(tokenizer):
    ids = tokenizer.encode("東")
    assert len(ids) > 1  # the toy vocabulary has no merge for it: one token per byte
    deltas = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "東" and deltas[-1] == ""


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60), chunk=st.integers(1, 4))
def test_streamed_deltas_reassemble_the_text_and_never_split_a_character(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    if tokenizer.eos_token not in text:  # special tokens are not rendered as text
        assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_bytes_that_never_form_a_character_are_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("東")[:1]  # a lone lead byte
    deltas = stream(tokenizer, ids)
    assert deltas == ["", "\ufffd"]


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc\n", max_size=40),
    stops=st.lists(st.text("abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    matcher = StopMatcher(stops)
    out, stopped = "", False
    for a, b in zip(bounds, bounds[1:]):
        emitted, stopped = matcher.feed(text[a:b])
        out += emitted
        assert not any(s in out for s in stops)  # stop text is never streamed
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert (out, stopped) == reference_cut(text, stops)
