"""Each agent's tokenizer and chat template, loaded once per process.

A slime rollout process makes thousands of model calls per step; the host's own multi-agent
example reloaded the tokenizer on every call. Here a tokenizer is loaded once per (path, chat
template), prompts are rendered through the agent's own chat template, and rendered prompts
are cached, so the eight episodes of one prompt group tokenize their shared prompt once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from .config import ConfigError

_LOADED: dict[tuple[str, str | None], AgentTokenizer] = {}
_LOCK = threading.Lock()

# Paragraph breaks: after a blank line, before the next non-space character. Byte-level BPE
# tokenizers (GPT-2, Llama 3, Qwen) never merge across such a point, so encoding the paragraphs
# one by one gives the same ids as encoding the whole text, and each paragraph (a problem
# statement, a quoted solution) is encoded once however many prompts it appears in. Whether a
# tokenizer has this property is checked on probe texts when it loads.
_PARAGRAPH = re.compile(r"(?<=\n\n)(?=\S)")
_PIECEWISE_MIN_CHARS = 256
_PROBES = [
    "Problem:\nWhat is 12 + 30?\n\n### Solution 1\nWe add: 12 + 30 = 42. The answer is \\boxed{42}.\n\n"
    "### Solution 2\n  indented\n\n\n3 blank lines, digits 12345 and  spaces\n\nÜnïcödé 数学 ✓\n\nend.",
    "a\n\nb\n\n c\n\n\td\n\n'quoted' \"text\"\n\n$x^2$\n\n<|im_end|>\n\n<|im_start|>user\nhi",
]


class TemplateError(ValueError):
    """A chat template that cannot render a conversation incrementally."""


class AgentTokenizer:
    """A Hugging Face tokenizer with the rendering the transcripts need."""

    # Rendered prompts are cached for reuse while an episode is in flight (one prompt group's
    # shared prompt, the rewriters' shared prompt); pieces (paragraphs) for reuse across prompts.
    # Both are bounded: a cached 3k-token prompt holds ~100 KB of Python ints.
    def __init__(self, hf_tokenizer: Any, name: str, cache_size: int = 512, piece_cache_size: int = 4096):
        self.hf = hf_tokenizer
        self.name = name
        self._cache: OrderedDict[tuple, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._piecewise: bool | None = None  # decided on first use
        self._cache_size = cache_size
        self._piece_cache_size = piece_cache_size
        self._lock = threading.Lock()
        # The Rust tokenizer behind a fast HF tokenizer, called directly: less overhead, no
        # length warnings, and decoding without "clean-up" of spaces (the text must spell the ids).
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        self._backend = backend if type(backend).__module__.startswith("tokenizers") else None
        # tokenizers >= 0.20: the same ids without computing character offsets (a quarter faster).
        self._fast_encode = getattr(self._backend, "encode_batch_fast", None)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        if self.eos_token_id is None and hf_tokenizer.pad_token_id is not None:
            self.eos_token_id = hf_tokenizer.pad_token_id

    # --- rendering -----------------------------------------------------------------------

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if getattr(self.hf, "chat_template", None) is None:
            raise TemplateError(
                f"tokenizer {self.name} has no chat template; set `chat_template` for this agent in the config"
            )
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added), paragraph by paragraph when that is exact."""
        if self._piecewise is None:
            self._piecewise = all(self._encode_whole(p) == self._encode_pieces(p) for p in _PROBES)
        if self._piecewise and len(text) >= _PIECEWISE_MIN_CHARS:
            return self._encode_pieces(text)
        return self._encode_whole(text)

    def _encode_whole(self, text: str) -> list[int]:
        if self._fast_encode is not None:
            return self._fast_encode([text], add_special_tokens=False)[0].ids
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.hf.encode(text, add_special_tokens=False))

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._pieces
        for piece in _PARAGRAPH.split(text):
            hit = cache.get(piece)
            if hit is None:
                hit = self._encode_whole(piece)
                with self._lock:
                    cache[piece] = hit
                    if len(cache) > self._piece_cache_size:
                        cache.popitem(last=False)
            ids.extend(hit)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, str]]) -> tuple[str, tuple[int, ...]]:
        """The rendered text and token ids of a conversation that the agent answers next.

        Cached, and shared by every transcript that starts from the same messages (the ids are a
        tuple, so no one can change them under the others).
        """
        key = tuple((m["role"], m["content"]) for m in messages)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        text = self.render_text(messages, add_generation_prompt=True)
        value = (text, tuple(self.encode(text)))
        with self._lock:
            self._cache[key] = value
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return value

    def continuation(
        self, held_text: str, history: list[dict[str, str]], new: list[dict[str, str]], add_generation_prompt: bool
    ) -> str:
        """The text to append to a transcript that holds `held_text` so it shows `new` messages.

        `history` is the conversation the transcript shows so far (the agent's own turns as
        generated text). The template renders history and history+new; their difference is the
        new part. When the held text stops short of what the template expects after the last
        turn (a turn cut at its token cap has no end-of-turn marker), the missing closing text is
        added first, so the agent sees a well-formed conversation.
        """
        base = self.render_text(history, add_generation_prompt=False)
        full = self.render_text(history + new, add_generation_prompt=add_generation_prompt)
        if not full.startswith(base):
            raise TemplateError(
                f"the chat template of {self.name} renders earlier messages differently once a message is "
                "added; set a `chat_template` for this agent that only appends"
            )
        suffix = full[len(base) :]
        if base.startswith(held_text):
            return base[len(held_text) :] + suffix
        return suffix


def load_tokenizer(path: str, chat_template: str | None = None, key_hint: str = "") -> AgentTokenizer:
    """Load (once per process) the tokenizer at `path`, with an optional chat template override."""
    cache_key = (path, chat_template)
    with _LOCK:
        tok = _LOADED.get(cache_key)
        if tok is not None:
            return tok
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(
                "transformers is needed to load tokenizers; it comes with slime/Miles images, "
                "or install this package with the 'local' extra"
            ) from None
        try:
            hf = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        except Exception as exc:  # noqa: BLE001 - the loader raises many types; all mean "bad path"
            where = f"{key_hint}: " if key_hint else ""
            raise ConfigError(f"{where}cannot load a tokenizer from {path!r}: {exc}") from None
        if chat_template is not None:
            hf.chat_template = chat_template
        tok = AgentTokenizer(hf, name=path)
        _LOADED[cache_key] = tok
        return tok
