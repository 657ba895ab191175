"""What an agent's model can take: its vocabulary and its longest sequence.

A sample made with one model's tokenizer may not fit another job's model (token ids outside its
vocabulary, more tokens than its context). The producer checks each peer's samples before it
commits them, the consumer each item it leases, and the host's own model bounds the samples of
the agents it serves.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mrlx_plugin.core.values import JSONObject


class HasTokens(Protocol):
    """A queued item or a sample: whatever carries the token ids of a sequence."""

    @property
    def tokens(self) -> Sequence[int] | None: ...


@dataclass(frozen=True)
class ModelLimits:
    """The token ids and the sequence length an agent's trainer can take (None: not known)."""

    vocab_size: int | None
    max_length: int | None
    source: str  # where they were read, for messages

    def problem(self, item_or_sample: HasTokens, agent: str) -> str | None:
        """Why this item (or sample) cannot be trained by `agent`'s model, or None."""
        tokens = item_or_sample.tokens
        if tokens is None or not len(tokens):
            return None
        if self.vocab_size is not None:
            low, high = min(tokens), max(tokens)
            if high >= self.vocab_size or low < 0:
                bad = high if high >= self.vocab_size else low
                return (
                    f"token id {bad} is outside the vocabulary of {agent!r}'s model ({self.vocab_size} ids, "
                    f"{self.source})"
                )
        if self.max_length is not None and len(tokens) > self.max_length:
            return (
                f"{len(tokens)} tokens are more than {agent!r}'s model takes ({self.max_length}, "
                f"{self.source})"
            )
        return None


def read_model_limits(
    args: argparse.Namespace | None, model_dir: str | None, fallback_vocab: int | None = None
) -> ModelLimits:
    """An agent's limits: from the host's own flags where it has them (`--vocab-size`/the padded
    vocabulary, `--max-position-embeddings`), else from the model's `config.json` in `model_dir`
    (vocab_size; max_position_embeddings, times a rope_scaling factor), else the tokenizer's
    vocabulary (`fallback_vocab`). Blocking (reads a file): call it outside the event loop."""
    vocab = max_len = None
    where = []
    if args is not None:
        vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
        max_len = getattr(args, "max_position_embeddings", None)
        if vocab or max_len:
            where.append("the host's flags")
    config: JSONObject = {}
    if model_dir:
        try:
            with open(os.path.join(str(model_dir), "config.json"), encoding="utf-8") as handle:
                config = json.load(handle)
        except (OSError, ValueError):
            config = {}
        text_config = config.get("text_config")
        config = text_config if isinstance(text_config, dict) else config
    vocab_size, positions = config.get("vocab_size"), config.get("max_position_embeddings")
    if vocab is None and isinstance(vocab_size, int):
        vocab = vocab_size
        where.append(f"{model_dir}/config.json")
    if max_len is None and isinstance(positions, int):
        max_len = positions
        scaling = config.get("rope_scaling") or {}
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if isinstance(factor, (int, float)) and factor > 1:
            max_len = int(max_len * factor)
        if f"{model_dir}/config.json" not in where:
            where.append(f"{model_dir}/config.json")
    if vocab is None and fallback_vocab:
        vocab = fallback_vocab
        where.append("its tokenizer")
    return ModelLimits(
        int(vocab) if vocab else None, int(max_len) if max_len else None, " and ".join(where) or "unknown"
    )
