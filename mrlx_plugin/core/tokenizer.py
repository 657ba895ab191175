"""Each agent's tokenizer and chat template, loaded once per process.

A slime rollout process makes thousands of model calls per step; the host's own multi-agent
example reloaded the tokenizer on every call. Here a tokenizer is loaded once per (path, chat
template) by the `TokenizerCache` of the process's Runtime (agents of one model share it),
prompts are rendered through the agent's own chat template, and rendered prompts are cached,
so the eight episodes of one prompt group tokenize their shared prompt once.

Message content is text, never markup. What one agent wrote, a tool returned or a dataset holds
may contain the strings of the reader's special tokens (`<|im_end|>`, `<|im_start|>system`); a
conversation is therefore rendered with every message's content between two markers that only
this process knows, and the template's own text (its markup) is encoded with special tokens
recognised while the content between the markers is encoded with them split into ordinary
text (as `split_special_tokens=True` does). A message cannot open or close a turn.
"""

from __future__ import annotations

import contextlib
import functools
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mrlx_plugin.core.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Paragraph breaks: after a blank line, before the next non-space character. Byte-level BPE
# tokenizers (GPT-2, Llama 3, Qwen) never merge across such a point, so encoding the paragraphs
# one by one gives the same ids as encoding the whole text, and each paragraph (a problem
# statement, a quoted solution) is encoded once however many prompts it appears in. Whether a
# tokenizer has this property is checked on probe texts when it loads. The pattern starts with its
# newlines, so the regex engine searches for them (a look-behind would be tried at every
# character: eight times slower on a 9k-character prompt, and every new prompt is split).
_PARAGRAPH = re.compile(r"\n\n(?=\S)")
_PIECEWISE_MIN_CHARS = 256
_PROBES = [
    "Problem:\nWhat is 12 + 30?\n\n### Solution 1\nWe add: 12 + 30 = 42. The answer is \\boxed{42}.\n\n"
    "### Solution 2\n  indented\n\n\n3 blank lines, digits 12345 and  spaces\n\nÜnïcödé 数学 ✓\n\nend.",
    "a\n\nb\n\n c\n\n\td\n\n'quoted' \"text\"\n\n$x^2$\n\n<|im_end|>\n\n<|im_start|>user\nhi",
]


def _paragraphs(text: str) -> list[str]:
    """`text` cut at its paragraph breaks (`_PARAGRAPH`): each piece but the last ends with the
    blank line, and the next starts with the non-space character after it."""
    pieces = []
    start = 0
    for found in _PARAGRAPH.finditer(text):
        pieces.append(text[start : found.end()])
        start = found.end()
    pieces.append(text[start:])
    return pieces


class TemplateError(ValueError):
    """A chat template that cannot render a conversation incrementally."""


# The caches' budgets, in characters (of keys and texts) plus ids held: about 40 MB for rendered
# prompts of English text, 100 MB at most (a Python int in a tuple takes ~36 bytes, a character
# of ASCII text one). An entry past an eighth of its cache's budget is never cached: one request
# cannot flush a cache, and what is cached stays many entries.
PROMPT_CACHE_BUDGET = 8_000_000
PIECE_CACHE_BUDGET = 4_000_000  # each of the two piece caches (markup, content)
_LARGEST_ENTRY = 8  # the budget's share one entry may take: 1/8


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _SizedCache(Generic[K, V]):
    """A map bounded by the total size of its entries (and by their count), evicting the oldest
    first (`get(touch=True)` makes an entry the newest). Writers hold the tokenizer's lock."""

    def __init__(self, budget: int, max_entries: int):
        self.budget = budget
        self.largest = budget // _LARGEST_ENTRY
        self.max_entries = max_entries
        self.size = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._items))

    def keys(self) -> list[K]:
        return list(self._items)

    def get(self, key: K, touch: bool = False) -> V | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        if touch:
            self._items.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Cache `value` as `size` (characters + ids); False when it is too large to cache."""
        if size > self.largest:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= old[1]
        self._items[key] = (value, size)
        self.size += size
        while self.size > self.budget or len(self._items) > self.max_entries:
            self.size -= self._items.popitem(last=False)[1][1]
        return True


def _plain_backend(backend: Any) -> Tokenizer | None:
    """A copy of a Rust tokenizer that encodes special-token strings as ordinary text."""
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        return None
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return plain


class AgentTokenizer:
    """A Hugging Face tokenizer with the rendering the transcripts need."""

    # Rendered prompts are cached for reuse while an episode is in flight (one prompt group's
    # shared prompt, the rewriters' shared prompt); pieces (paragraphs) for reuse across prompts.
    # All are bounded by size (characters + ids, see PROMPT_CACHE_BUDGET) and by count: a cached
    # 3k-token prompt holds ~100 KB of Python ints.
    def __init__(
        self,
        hf_tokenizer: Any,  # a transformers tokenizer, used as one (transformers is not imported here)
        name: str,
        cache_size: int = 512,
        piece_cache_size: int = 4096,
        cache_budget: int = PROMPT_CACHE_BUDGET,
        piece_budget: int = PIECE_CACHE_BUDGET,
    ):
        self.hf = hf_tokenizer
        self.name = name
        # (tools_key, messages) -> (text, ids)
        self._cache: _SizedCache[tuple, tuple[str, tuple[int, ...]]] = _SizedCache(cache_budget, cache_size)
        # Pieces' ids are tuples: the garbage collector stops tracking a tuple of ints once it has
        # seen it, so thousands of cached pieces add nothing to its passes (lists would).
        # Markup pieces (special tokens live) and content pieces (special tokens as text).
        self._pieces: _SizedCache[str, tuple[int, ...]] = _SizedCache(piece_budget, piece_cache_size)
        self._text_pieces: _SizedCache[str, tuple[int, ...]] = _SizedCache(piece_budget, piece_cache_size)
        # Renderings lent to a synchronous open (`lend`), and whether this thread's encodes may
        # fill the piece caches (not while rendering what may yet be refused: `prompt_ids(cache=False)`).
        self._lent: dict[tuple, tuple[str, tuple[int, ...]]] = {}
        self._local = threading.local()
        self._piecewise: bool | None = None  # decided on first use
        self._text_piecewise: bool | None = None
        self._lock = threading.Lock()
        # The Rust tokenizer behind a fast HF tokenizer, called directly: less overhead, no
        # length warnings, and decoding without "clean-up" of spaces (the text must spell the ids).
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        self._backend = backend if type(backend).__module__.startswith("tokenizers") else None
        # tokenizers >= 0.20: the same ids without computing character offsets (a quarter faster).
        self._fast_encode = getattr(self._backend, "encode_batch_fast", None)
        # A second Rust tokenizer for content, with special-token matching off (a per-object
        # setting: flipping it on the shared one would race with other threads' encodes).
        self._text_backend = _plain_backend(self._backend)
        self._text_fast_encode = getattr(self._text_backend, "encode_batch_fast", None)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        if self.eos_token_id is None and hf_tokenizer.pad_token_id is not None:
            self.eos_token_id = hf_tokenizer.pad_token_id
        # Every id this tokenizer can decode (added tokens included); a model's embedding may
        # have padding rows above it, but an id there spells nothing another agent could read.
        self.vocab_size: int = len(hf_tokenizer)
        # Content markers: private-use characters around a per-process random nonce, so no
        # message (whatever an agent writes) can contain or forge one.
        self._text_table: list[bytes] | None | bool = False  # built on first use (answer_text)
        nonce = secrets.token_hex(8)
        self._open = f"\ue000{nonce}\ue001"
        self._close = f"\ue000{nonce}\ue002"
        self._marker = re.compile(f"\ue000{nonce}([\ue001\ue002])")
        self._nonce = nonce

    # --- encoding ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (no special tokens added; special-token strings ARE the
        special tokens), paragraph by paragraph when that is exact. Never use it for content."""
        if self._piecewise is None:
            self._piecewise = all(self._encode_whole(p) == self._encode_pieces(p) for p in _PROBES)
        if self._piecewise and len(text) >= _PIECEWISE_MIN_CHARS:
            return self._encode_pieces(text)
        return self._encode_whole(text)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: a special token's string in it (`<|im_end|>`) is
        encoded as the characters it is made of, never as the special token."""
        if self._text_piecewise is None:
            self._text_piecewise = all(
                self._encode_whole(p, plain=True) == self._encode_pieces(p, plain=True) for p in _PROBES
            )
        if self._text_piecewise and len(text) >= _PIECEWISE_MIN_CHARS:
            return self._encode_pieces(text, plain=True)
        return self._encode_whole(text, plain=True)

    def _encode_whole(self, text: str, plain: bool = False) -> list[int]:
        if plain:
            if self._text_fast_encode is not None:
                return self._text_fast_encode([text], add_special_tokens=False)[0].ids
            if self._text_backend is not None:
                return self._text_backend.encode(text, add_special_tokens=False).ids
            return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        if self._fast_encode is not None:
            return self._fast_encode([text], add_special_tokens=False)[0].ids
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.hf.encode(text, add_special_tokens=False))

    def _encode_pieces(self, text: str, plain: bool = False) -> list[int]:
        ids: list[int] = []
        cache = self._text_pieces if plain else self._pieces
        store = getattr(self._local, "store", True)
        for piece in _paragraphs(text):
            hit = cache.get(piece)
            if hit is None:
                hit = tuple(self._encode_whole(piece, plain))
                if store:
                    with self._lock:
                        cache.put(piece, hit, len(piece) + len(hit))
            ids.extend(hit)
        return ids

    def _encode_markup(self, text: str) -> tuple[int, ...]:
        """Template text between contents: short and repeated, so cached whole (what is larger
        than the cache's share for one entry, a long tools list's markup, is not)."""
        hit = self._pieces.get(text)
        if hit is None:
            hit = tuple(self._encode_whole(text))
            if getattr(self._local, "store", True):
                with self._lock:
                    self._pieces.put(text, hit, len(text) + len(hit))
        return hit

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token spells (from above): a text of more bytes than
        `n * max_token_bytes` is more than n tokens, known without encoding it."""
        self.answer_text([])  # the byte table, where the tokenizer is byte-level
        table = self._text_table
        if isinstance(table, list):
            return max(1, max(map(len, table)))
        # Vocabulary strings are the pieces as written ("▁the", "<0x0A>"): never fewer bytes than spelled.
        return max(1, max(len(piece.encode()) for piece in self.hf.get_vocab()))

    @functools.cached_property
    def added_token_texts(self) -> tuple[str, ...]:
        """The strings of the added tokens (special and not): text that the chat template's markup
        would turn into those tokens."""
        return tuple(t for t in self.hf.get_added_vocab() if t)

    def answer_text(self, ids: list[int]) -> str:
        """What generated ids spell, special tokens left out (ids must be in the vocabulary).

        The same text as `decode(ids)`; for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen)
        from a table of each id's bytes, a tenth of the Rust decoder's time on a 256-token
        answer (it runs on every engine answer)."""
        table = self._text_table
        if table is False:
            table = self._text_table = _byte_table(self)
        if not isinstance(table, list) or not ids:  # None: no byte table for this tokenizer
            return self.decode(ids, skip_special_tokens=True)
        return b"".join(map(table.__getitem__, ids)).decode("utf-8", "replace")

    # --- rendering -----------------------------------------------------------------------

    def render_text(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        """The chat template's text of `messages`; `tools` (OpenAI function specs) go to the
        template as its `tools` variable, as transformers passes them."""
        if getattr(self.hf, "chat_template", None) is None:
            raise TemplateError(
                f"tokenizer {self.name} has no chat template; set `chat_template` for this agent in the "
                "config"
            )
        if tools:
            return self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _wrapped(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The messages with each string content between the content markers."""
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                if self._nonce in content:  # cannot happen by chance (64 random bits); refuse a forgery
                    raise TemplateError(
                        "a message holds this process's content marker; refusing to render it"
                    )
                m = {**m, "content": self._open + content + self._close}
            out.append(m)
        return out

    def _segments(self, rendered: str, prefix_markup: str = "") -> tuple[str, list[int]]:
        """Text and ids of a rendering with marked contents: markup encoded with special tokens,
        content as plain text."""
        parts = self._marker.split(rendered)
        # parts: markup, kind, text, kind, text, ...; kinds alternate open (\ue001), close (\ue002)
        # A marker cut apart (the template sliced a content) leaves its first character in markup.
        if any("\ue000" in parts[k] for k in range(0, len(parts), 4)):
            raise TemplateError(
                f"the chat template of {self.name} changes message content (it cuts a message apart); "
                "set a `chat_template` for this agent that writes each message's content as it is"
            )
        texts: list[str] = []
        ids: list[int] = []
        markup = prefix_markup + parts[0]
        if markup:
            texts.append(markup)
            ids.extend(self._encode_markup(markup))
        for k in range(1, len(parts), 4):
            if k + 3 >= len(parts) or parts[k] != "\ue001" or parts[k + 2] != "\ue002":
                raise TemplateError(
                    f"the chat template of {self.name} changes message content (it cuts a message apart); "
                    "set a `chat_template` for this agent that writes each message's content as it is"
                )
            content, markup = parts[k + 1], parts[k + 3]
            if content:
                texts.append(content)
                ids.extend(self.encode_text(content))
            if markup:
                texts.append(markup)
                ids.extend(self._encode_markup(markup))
        return "".join(texts), ids

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> tuple[str, list[int]]:
        """The rendered text of a conversation and its ids, every message's content as plain text
        (tool specs are the template's markup: they come from the system's code, not from a model)."""
        return self._segments(self.render_text(self._wrapped(messages), add_generation_prompt, tools))

    def prompt_ids(
        self,
        messages: list[dict[str, str]],
        tools: list[dict] | None = None,
        tools_key: str = "",
        cache: bool = True,
    ) -> tuple[str, tuple[int, ...]]:
        """The rendered text and token ids of a conversation that the agent answers next.

        Cached, and shared by every transcript that starts from the same messages (the ids are a
        tuple, so no one can change them under the others). Contents are plain text. `tools_key`
        stands for `tools` in the cache's key (their canonical JSON). `cache=False`: a rendering
        that may yet be refused (over the context): neither it nor its pieces are cached (a hit
        is still used); `keep` caches it once it is accepted.
        """
        key = _prompt_key(messages, tools_key)
        with self._lock:
            hit = self._lent.get(key) or self._cache.get(key, touch=True)
        if hit is not None:
            return hit
        store = getattr(self._local, "store", True)
        self._local.store = store and cache
        try:
            text, ids = self.render_chat(messages, add_generation_prompt=True, tools=tools)
        finally:
            self._local.store = store
        value = (text, tuple(ids))
        if cache:
            self.keep(messages, tools_key, value)
        return value

    def keep(
        self, messages: list[dict[str, str]], tools_key: str, value: tuple[str, tuple[int, ...]]
    ) -> bool:
        """Cache an accepted rendering (`prompt_ids(..., cache=False)`'s); False when it is too
        large to cache (past an eighth of the budget)."""
        key = _prompt_key(messages, tools_key)
        size = _key_chars(key) + len(value[0]) + len(value[1])
        with self._lock:
            return self._cache.put(key, value, size)

    @contextlib.contextmanager
    def lend(
        self, messages: list[dict[str, str]], tools_key: str, value: tuple[str, tuple[int, ...]]
    ) -> Iterator[None]:
        """`prompt_ids(messages)` gives `value` within this block, without caching it: a rendering
        made off the event loop handed to a synchronous open (`Episode.open_transcript`) before
        it is known to fit."""
        key = _prompt_key(messages, tools_key)
        with self._lock:
            self._lent[key] = value
        try:
            yield
        finally:
            with self._lock:
                self._lent.pop(key, None)

    def cache_sizes(self) -> dict[str, tuple[int, int]]:
        """Each cache's (size, budget), in characters and ids held."""
        with self._lock:
            return {
                name: (c.size, c.budget)
                for name, c in (
                    ("prompts", self._cache),
                    ("markup", self._pieces),
                    ("text", self._text_pieces),
                )
            }

    def continuation(
        self,
        held_text: str,
        history: list[dict[str, str]],
        new: list[dict[str, str]],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        held_ids: Sequence[int] = (),
    ) -> tuple[str, list[int]]:
        """The text and ids to append to a transcript that holds `held_text` (whose ids end with
        `held_ids`) so it shows `new`.

        `history` is the conversation the transcript shows so far (the agent's own turns as the
        text their ids spell). The template renders history and history+new; their difference is
        the new part, whose message contents are encoded as plain text. When the held text stops
        short of what the template writes after the last message (a turn cut at its token cap
        has no end-of-turn marker; a turn that sampled its end-of-turn token lacks the newline
        after it), the missing closing markup is added first, so the agent sees a well-formed
        conversation.
        """
        base = self.render_text(history, add_generation_prompt=False, tools=tools)
        full = self.render_text(
            history + self._wrapped(new), add_generation_prompt=add_generation_prompt, tools=tools
        )
        if not full.startswith(base):
            raise TemplateError(
                f"the chat template of {self.name} renders earlier messages differently once a message is "
                "added; set a `chat_template` for this agent that only appends"
            )
        closing = (
            base[len(held_text) :] if base.startswith(held_text) else self._closing(history, tools, held_ids)
        )
        return self._segments(full[len(base) :], prefix_markup=closing)

    def _closing(
        self, history: list[dict[str, str]], tools: list[dict] | None, held_ids: Sequence[int]
    ) -> str:
        """The markup the template writes after the last message's content, less what the held
        ids already end with (whole tokens: the end-of-turn token the model sampled).

        For a held text that is no prefix of the history's rendering: the last turn's ids spell
        more than its message shows (a special token sampled mid-answer, which readers are not
        shown), so the closing markup is found from the last message's content on."""
        if not history:
            return ""
        marked = self.render_text(history[:-1] + self._wrapped(history[-1:]), False, tools)
        if self._close not in marked:  # a message without text content
            return ""
        after = marked.rsplit(self._close, 1)[1]
        after_ids = self._encode_markup(after)
        for k in range(min(len(after_ids), len(held_ids)), 0, -1):
            if tuple(held_ids[-k:]) == after_ids[:k]:
                taken = self.decode(list(after_ids[:k]), skip_special_tokens=False)
                return after[len(taken) :] if after.startswith(taken) else after
        return after


def _prompt_key(messages: list[dict[str, str]], tools_key: str) -> tuple:
    return (tools_key, *((m["role"], m["content"]) if len(m) == 2 else tuple(m.items()) for m in messages))


def _key_chars(key: tuple) -> int:
    """The characters a prompt cache key holds (its strings)."""
    n = len(key[0])
    for m in key[1:]:
        for part in m:
            if isinstance(part, str):
                n += len(part)
            elif isinstance(part, tuple):
                n += sum(len(x) for x in part if isinstance(x, str))
    return n


def gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, to that byte."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_table(tok: AgentTokenizer) -> list[bytes] | None:
    """Each id's bytes, for a tokenizer whose decoder is GPT-2's byte-level one; None otherwise.

    Special tokens spell nothing (they are skipped), other added tokens their content. Checked
    against the Rust decoder on probe texts, on the whole vocabulary in one sequence and on
    added tokens alone; any difference: None (the Rust decoder is then used).
    """
    import json

    backend = tok._backend
    if backend is None:
        return None
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except ValueError:
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    chars = gpt2_byte_chars()
    table: list[bytes] = [b""] * tok.vocab_size
    for token, i in backend.get_vocab(with_added_tokens=False).items():
        if not 0 <= i < len(table) or any(c not in chars for c in token):
            return None
        table[i] = bytes(chars[c] for c in token)
    for i, added in backend.get_added_tokens_decoder().items():
        if not 0 <= i < len(table):
            return None
        table[i] = b"" if added.special else backend.decode([i], skip_special_tokens=True).encode()

    def fast(ids: list[int]) -> str:
        return b"".join(table[i] for i in ids).decode("utf-8", "replace")

    samples = [tok._encode_whole(p) for p in _PROBES] + [list(range(tok.vocab_size))]
    samples += [[i] for i in backend.get_added_tokens_decoder()] + [
        [i] for i in range(min(tok.vocab_size, 512))
    ]
    if any(fast(ids) != backend.decode(ids, skip_special_tokens=True) for ids in samples):
        return None
    return table


def load_tokenizer(path: str, chat_template: str | None = None, key_hint: str = "") -> AgentTokenizer:
    """Load the tokenizer at `path`, with an optional chat template override (blocking; uncached:
    a Runtime loads through its `TokenizerCache`)."""
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
    tok.answer_text([])  # build the byte table now, not on the first answer (in the event loop)
    return tok


class TokenizerCache:
    """Tokenizers loaded once per (path, chat template): agents of one model share one tokenizer,
    and with it its caches of rendered prompts. Owned by the Runtime that loads through it."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str | None], AgentTokenizer] = {}
        self._lock = threading.Lock()  # loads happen in threads (the Runtime is built off the loop)

    def load(self, path: str, chat_template: str | None = None, key_hint: str = "") -> AgentTokenizer:
        with self._lock:
            tok = self._loaded.get((path, chat_template))
            if tok is None:
                tok = self._loaded[(path, chat_template)] = load_tokenizer(path, chat_template, key_hint)
            return tok
