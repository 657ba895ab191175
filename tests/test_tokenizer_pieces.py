"""Piecewise encoding: a text is cut at its paragraph breaks, each piece encoded (and cached) on
its own, and the ids are those of the whole text."""

from __future__ import annotations

import random

import pytest

from mrlx_plugin.core.tokenizer import _paragraphs, load_tokenizer


def _reference_cuts(text: str) -> list[int]:
    """Where a paragraph starts: after a blank line ("\\n\\n"), at a non-space character."""
    return [i for i in range(2, len(text)) if text[i - 2 : i] == "\n\n" and not text[i].isspace()]


@pytest.mark.parametrize("seed", range(4))
def test_paragraphs_cut_exactly_at_blank_lines_before_text(seed):
    rng = random.Random(seed)
    alphabet = ["\n", "\n", "\n\n", " ", "\t", "a", "b", "é", "\u3000", "\r"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        pieces = _paragraphs(text)
        assert "".join(pieces) == text
        cuts, at = [], 0
        for piece in pieces[:-1]:
            at += len(piece)
            cuts.append(at)
        assert cuts == _reference_cuts(text), repr(text)


def test_piecewise_ids_are_the_whole_texts_ids(tiny_tokenizer_dir):
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    tok.encode_text("probe"), tok.encode("probe")  # decides, on the probe texts, whether pieces are exact
    assert tok._text_piecewise and tok._piecewise, "the local byte-level BPE is encoded piece by piece"
    rng = random.Random(0)
    words = ["the", "answer", "is", "\\boxed{42}", "<|im_end|>", "x^2", "Ünï", "```", "  ", "\t", "7."]
    for _ in range(50):
        paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(6)]
        text = "".join(p + rng.choice(["\n\n", "\n\n\n", "\n \n", "\n", "\n\n  "]) for p in paragraphs)
        assert len(text) >= 256  # long enough to be encoded piece by piece
        for _ in range(2):  # the second time from the cached pieces
            assert tok.encode_text(text) == tok._encode_whole(text, plain=True)
            assert tok.encode(text) == tok._encode_whole(text)
