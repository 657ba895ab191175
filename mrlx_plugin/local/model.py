"""Tiny causal language models and tokenizers, built locally from a config.

Tests, examples and a newcomer's laptop need a real Hugging Face model directory (config,
weights, tokenizer, chat template) that loads through the ordinary `from_pretrained` path, but
they must never download one. This module builds such a directory from nothing:

- a byte-level BPE tokenizer trained deterministically on a small generated corpus (arithmetic,
  math answers in `\\boxed{...}`, `Judgment: N` lines, short English, chat markup), with the
  ChatML special tokens and chat template; byte-level, so any text round-trips;
- a small Llama-architecture causal LM whose weights are initialised from a seed.

`ensure_model` builds a directory once and is safe when several processes race for it.
`ensure_adapter` builds, the same way, a LoRA adapter (peft's directory layout) for such a model:
several agents can then be several adapters on one base model, served by one engine.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    # A policy: a whole causal LM, or a peft model of a LoRA adapter on one.
    Policy = PreTrainedModel | PeftModel

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# ChatML. Each message renders as "<|im_start|>{role}\n{content}<|im_end|>\n", so the rendering
# of a conversation is a prefix of the rendering of the same conversation with one more
# message: transcripts can then be extended by appending tokens, never re-tokenising. Tools, when
# given, come first as a system block, a line per tool: "name(param, ...): description" (terse:
# these byte-level models spend a token on every two or three characters of a JSON schema); a
# `tool` message is a message like any other. Without tools the rendering is plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n# Tools' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = ((fn['parameters'] or {})['properties'] or {}) | list -%}"
    "{{- '\n' + fn['name'] + '(' + params | join(', ') + ')' -}}"
    "{%- if fn['description'] -%}{{- ': ' + fn['description'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Architecture sizes. "tiny" is for tests (fast to build, load and run); "small" is for demos
# that must visibly learn a toy arithmetic task on two CPU cores within minutes.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": 512,
    },
    "small": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": 512,
    },
}

# Written beside the weights; records how the directory was built so `ensure_model` (and
# `ensure_adapter`) can tell a finished build from a stranger's directory or a build with other
# settings.
BUILD_INFO_FILE = "mrlx_model.json"
ADAPTER_INFO_FILE = "mrlx_adapter.json"
_BUILD_LOCK = threading.Lock()
_BUILD_FORMAT = 1

# Every linear layer of a Llama block; not lm_head or the embeddings, so an adapter file stays
# small and the engine's vocabulary is the base model's whatever adapter a request names.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What the shapes of an adapter's matrices follow from: an adapter fits any base that agrees on these.
_ADAPTER_BASE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)

_WORDS = (  # noqa: SIM905 - a word list reads best as text
    "the a an and or but if then so of to in on at for with from by is are was be it this that "
    "these those we you they he she one two three four five six seven eight nine ten number sum "
    "difference product total answer question solve compute find value result step first next "
    "finally therefore because let me check add subtract multiply divide plus minus times equals "
    "correct wrong best choose pick solution candidate judge judgment review rewrite improve "
    "explain reason think carefully short long good bad yes no true false apple box boxes cat "
    "dog book books pen pens student students teacher has have had gives gave buys bought left "
    "right each every more less than how many much what which who when where why"
).split()
_SYLLABLES = (  # noqa: SIM905 - a word list reads best as text
    "ka ri to na me lo su pe vi da mo ne ra ti ku so be la fi go zu ha wa ye xo qu ce ji pu dy "
    "an en in on un ar er or ur al el il ol ul as es is os us"
).split()


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _arith_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return rng.choice(
        [
            f"{a}{op}{b}={value}",
            f"{a} {op} {b} = {value}",
            f"What is {a}{op}{b}? The answer is \\boxed{{{value}}}.",
            f"Question: compute {a} {op} {b}.\nAnswer: {a} {op} {b} = {value}, so \\boxed{{{value}}}",
            f"Let me compute. {a}{op}{b}={value}. Therefore the answer is \\boxed{{{value}}}.",
        ]
    )


def training_corpus(vocab_size: int, seed: int = 0) -> list[str]:
    """The generated text the tokenizer is trained on (deterministic for a given size and seed).

    The corpus grows with the vocabulary so that a large vocabulary (thousands of merges) has
    enough distinct words to fill it; pseudo-words made of syllables supply that variety.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    n = max(3000, vocab_size * 6)
    for i in range(n):
        kind = i % 6
        if kind == 0:
            lines.append(_arith_line(rng))
        elif kind == 1:
            k = rng.randint(1, 4)
            lines.append(f"Candidate {k} is the best answer.\nJudgment: {k}")
        elif kind == 2:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".")
        elif kind == 3:
            q = _arith_line(rng)
            lines.append(
                f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
                f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n"
                f"Let me think step by step.{IM_END}\n"
            )
        else:
            lines.append(" ".join(_pseudo_word(rng) for _ in range(rng.randint(3, 10))))
    return lines


def _train_tokenizer_object(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Digits one by one (as Qwen and Llama 3 do): a small model learns arithmetic far more
    # easily when "127" is three tokens than when it is one opaque id.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Sorted so that the byte alphabet gets the same ids on every run.
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(vocab_size), trainer=trainer)
    return tok


def build_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with the ChatML template and save it to `out_dir`.

    Returns the `transformers.PreTrainedTokenizerFast`; `AutoTokenizer.from_pretrained(out_dir)`
    loads the same tokenizer. `vocab_size` counts the 3 special tokens and the 256 byte symbols,
    so it must be at least 259 + 1. Deterministic: the same size gives the same vocabulary.
    """
    if not isinstance(vocab_size, int) or vocab_size < 260:
        raise ValueError(
            "vocab_size must be an integer >= 260 (3 special tokens + 256 bytes + merges), got "
            f"{vocab_size!r}"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import PreTrainedTokenizerFast

    tok = _train_tokenizer_object(vocab_size)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        model_max_length=PRESETS["tiny"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    # Name the generic fast class, which every transformers version since 4.x knows and which
    # loads tokenizer.json verbatim (transformers 5 writes its own new class name here).
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    return hf


def model_config(
    preset: str = "tiny", vocab_size: int = 512, pad_token_id: int = 0, eos_token_id: int = 2
) -> LlamaConfig:
    """The `transformers.LlamaConfig` of a preset, for a vocabulary of `vocab_size` ids.

    Llama rather than Qwen2: transformers 5 loads the tokenizer of a "qwen2" model directory
    through its own Qwen2 class, which rebuilds the pre-tokenizer and adds an NFC normaliser,
    so the loaded tokenizer would not be the one that was built. For "llama" it loads
    tokenizer.json as saved.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    from transformers import LlamaConfig

    sizes = {k: v for k, v in PRESETS[preset].items() if k != "vocab_size"}
    return LlamaConfig(
        vocab_size=vocab_size,
        # Untied: with tied embeddings a freshly initialised model mostly repeats its last
        # input token under greedy decoding, which makes a poor stand-in in tests.
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
        **sizes,
    )


def build_model(
    out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0, vocab_size: int | None = None
) -> Path:
    """Build a tokenizer and a freshly initialised causal LM and save both into `out_dir`.

    `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
    then load them. The weights depend only on (preset, seed, vocab size), so two builds with
    the same arguments are identical. `vocab_size` defaults to the preset's; the model's
    vocabulary is exactly the tokenizer's.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    size = int(vocab_size if vocab_size is not None else PRESETS[preset]["vocab_size"])
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=size)
    config = model_config(
        preset, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    # Initialisation draws from torch's global generator: seed it inside a saved-and-restored
    # state (the caller's random stream is left as it was), one build at a time per process
    # (two threads seeding the one global generator would interleave their draws).
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **_float32_kwargs())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    info = {"format": _BUILD_FORMAT, "preset": preset, "seed": seed, "vocab_size": size}
    (out / BUILD_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return out


def _build_once(
    out: Path,
    record: str,
    marker: str,
    wanted: Mapping[str, object],
    build: Callable[[Path], object],
    what: str,
) -> Path:
    """Build into `out` once: `build(tmp)` fills a private temporary directory beside `out` (and
    writes `record` there), which is then renamed into place; a loser of a race discards its copy.
    A finished directory whose `record` is not `wanted` is an error."""

    def built(path: Path) -> bool:
        return (path / record).is_file() and (path / marker).is_file()

    if not built(out):
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(
                f"{out} exists but holds no {what} built by mrlx_plugin ({record} missing); "
                "remove it or choose another directory"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
        try:
            build(tmp)
            try:
                # rename() replaces an empty directory atomically and fails on a non-empty one,
                # which is exactly the "someone else finished first" case.
                os.rename(tmp, out)
            except OSError:
                if not built(out):
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    have = json.loads((out / record).read_text())
    if have != wanted:
        raise ValueError(
            f"{out} holds {what} built with {have}, not {wanted}; remove it or choose another directory"
        )
    return out


def ensure_model(
    out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0, vocab_size: int | None = None
) -> Path:
    """Return `out_dir`, building the model there first if it is not there yet.

    Idempotent and safe when several processes call it at once: each builds into a private
    temporary directory beside `out_dir` and renames it into place; a loser of the race
    discards its copy. A finished directory built with other settings is an error (rather than
    silently serving a different model than asked for).
    """
    size = int(vocab_size if vocab_size is not None else PRESETS.get(preset, {}).get("vocab_size", 512))
    wanted = {"format": _BUILD_FORMAT, "preset": preset, "seed": seed, "vocab_size": size}
    return _build_once(
        Path(out_dir),
        BUILD_INFO_FILE,
        "config.json",
        wanted,
        lambda tmp: build_model(tmp, preset=preset, seed=seed, vocab_size=size),
        "a model",
    )


def _peft() -> ModuleType:
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            f"LoRA adapters need peft ({exc}); install it with: pip install 'mrlx-plugin[local]'"
        ) from exc
    return peft


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a peft adapter (adapter_config.json) rather than a whole model."""
    return (Path(path) / "adapter_config.json").is_file()


class _AdapterInfo(TypedDict):
    """What an adapter was built with (its build record, `ADAPTER_INFO_FILE`)."""

    format: int
    rank: int
    alpha: float
    seed: int
    target_modules: list[str]
    base: dict[str, object]  # the base model's shapes, from its config.json


def _adapter_settings(base_dir: Path, rank: int, alpha: float, seed: int) -> _AdapterInfo:
    config = json.loads((base_dir / "config.json").read_text())
    return {
        "format": _BUILD_FORMAT,
        "rank": rank,
        "alpha": alpha,
        "seed": seed,
        "target_modules": list(LORA_TARGET_MODULES),
        "base": {key: config.get(key) for key in _ADAPTER_BASE_KEYS},
    }


def _build_adapter(out: Path, base_dir: Path, info: _AdapterInfo) -> None:
    import torch

    peft = _peft()
    config = peft.LoraConfig(
        r=info["rank"],
        lora_alpha=info["alpha"],
        lora_dropout=0.0,
        target_modules=list(LORA_TARGET_MODULES),
        task_type="CAUSAL_LM",
        init_lora_weights=True,  # B = 0: the adapter starts as the base model exactly
    )
    base = load_model(base_dir)
    # A's initialisation draws from torch's global generator: seeded inside a saved-and-restored
    # state, one build at a time per process, as in build_model.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(info["seed"])
        model = peft.get_peft_model(base, config)  # adapter "default": its files sit at the top of `out`
    model.save_pretrained(str(out))
    (out / ADAPTER_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")


def ensure_adapter(
    path: str | os.PathLike[str],
    base_dir: str | os.PathLike[str],
    *,
    rank: int = 16,
    alpha: float = 32,
    seed: int = 0,
) -> Path:
    """Return `path`, building a fresh LoRA adapter for the model at `base_dir` there first if it
    is not there yet: peft's adapter_config.json and adapter_model.safetensors, on every linear
    layer of the blocks, no dropout, B = 0 (so base + adapter computes what the base does) and A
    drawn from `seed`.

    Idempotent and safe when several processes call it at once, as `ensure_model`; a directory
    built with other settings (rank, alpha, seed, or a base of other shapes) is a ValueError.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    base = Path(base_dir)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} holds no model (config.json missing)")
    info = _adapter_settings(base, rank, alpha, seed)
    return _build_once(
        Path(path),
        ADAPTER_INFO_FILE,
        "adapter_config.json",
        info,
        lambda tmp: _build_adapter(tmp, base, info),
        "an adapter",
    )


def _quiet() -> None:
    """No per-file progress bars from transformers: the demo and the engines print their own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _float32_kwargs() -> dict[str, torch.dtype]:
    """The dtype keyword of `from_pretrained`/`from_config` (renamed `dtype` in transformers 4.56)."""
    import torch
    import transformers

    _quiet()
    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype": torch.float32} if (major, minor) >= (4, 56) else {"torch_dtype": torch.float32}


def load_model(model_dir: str | os.PathLike[str]) -> PreTrainedModel:
    """Load a causal LM from a local directory in float32 on the CPU (never from a hub)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, **_float32_kwargs())
    model.eval()
    return model


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in a local directory (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_policy(
    model_dir: str | os.PathLike[str],
    adapter_dir: str | os.PathLike[str] | None = None,
    *,
    trainable: bool = False,
) -> Policy:
    """The model at `model_dir` (as `load_model`), with the LoRA adapter at `adapter_dir` on it
    when given: a peft model whose only trainable parameters, with `trainable`, are the adapter's
    (the base stays frozen); without `trainable` nothing trains."""
    model = load_model(model_dir)
    if adapter_dir is None:
        return model
    if not is_adapter_dir(adapter_dir):
        # peft would take a missing local directory for a hub id and try to download it.
        raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter (adapter_config.json missing)")
    peft = _peft()
    model = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    model.eval()
    return model
