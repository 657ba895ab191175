"""Which LoRA adapters the embedded engine serves: plain LoRA, row by row in batches shared with
other adapters and the base model. `adapter_refusal` reads an adapter_config.json before a load;
`check_weight_names` and `check_coverage` read its weights file before and after peft loads it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import orjson

if TYPE_CHECKING:
    import torch

# peft's init_lora_weights methods that rewrite the base weights of the layers they adapt when the
# adapter is built, as a load builds it before reading its saved weights.
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")

# adapter_config.json settings whose adapter cannot be served side by side with others, row by row
# in one batch, each with why. A list or mapping counts when not empty, a *_config when set.
_UNMIXABLE_SETTINGS = {
    "use_dora": "peft cannot mix a DoRA adapter's rows with other rows in one batch",
    "modules_to_save": "the adapter replaces whole modules, and while it is loaded peft fails every batch "
    "that holds rows of other adapters",
    "trainable_token_indices": "the adapter retrains token embeddings, and while it is loaded peft fails "
    "every batch that holds rows of other adapters",
    "target_parameters": "peft cannot mix rows of an adapter on parameters (not modules) with other rows "
    "in one batch",
    "layer_replication": "peft would replicate the base model's layers on load, changing the base model "
    "and every other adapter",
    "kasa_config": "KaSA rewrites the base weights on load, changing the base model and every other adapter",
    "alora_invocation_tokens": "an activated LoRA acts only after its invocation tokens, which this engine "
    "does not locate: its rows would be the base model's",
    "arrow_config": "Arrow routes among all the LoRA adapters loaded beside it, so its rows would depend "
    "on the other adapters",
}


def adapter_refusal(config: Path) -> str | None:
    """Why this engine cannot serve the adapter whose adapter_config.json is `config`, or None.

    It serves plain LoRA adapters, row by row in batches shared with other adapters and the base:
    a setting that makes peft fail such a batch, or that changes the base model (and so every
    other row), is refused by name."""
    try:
        settings = orjson.loads(config.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        return f"{config} is not readable JSON ({exc})"
    if not isinstance(settings, dict):
        return f"{config} is not a JSON object"
    if settings.get("peft_type", "LORA") != "LORA":
        return f"{config} is a {settings.get('peft_type')} adapter; this engine serves LoRA adapters"
    reasons = []
    for key, why in _UNMIXABLE_SETTINGS.items():
        value = settings.get(key)
        if value is not None if key.endswith("_config") else bool(value):
            reasons.append(f"{key} = {_short(value)} ({why})")
    bias = settings.get("bias") or "none"
    if bias != "none":
        reasons.append(
            f"bias = {_short(bias)} (the adapter trained the base model's biases, which every row shares)"
        )
    init = settings.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        reasons.append(
            f"init_lora_weights = {_short(init)} (peft rewrites the base weights when it builds such an "
            "adapter, changing the base model and every other adapter; save it converted to plain LoRA "
            "with save_pretrained's path_initial_model_for_weight_conversion)"
        )
    if not reasons:
        return None
    return (
        f"{config} sets {'; '.join(reasons)}. This engine serves plain LoRA adapters only, side by side "
        "in shared batches; train or save the adapter without these settings"
    )


def _short(value: object, limit: int = 80) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


class AdapterWeightsError(ValueError):
    """An adapter directory whose weights file does not fit its adapter_config.json."""


# How many tensor names a refusal quotes.
_QUOTED_NAMES = 3


def _quote(names: list[str]) -> str:
    shown = ", ".join(names[:_QUOTED_NAMES])
    return shown + (f", ... ({len(names) - _QUOTED_NAMES} more)" if len(names) > _QUOTED_NAMES else "")


def check_weight_names(path: str) -> str:
    """The weights file of the peft adapter directory `path` (its name), after checking that each
    tensor in it is a LoRA weight. peft loads the other names of a file as they are: one that
    names a base model weight (a whole lm_head, a bias) would be written into the base model that
    every row shares. safetensors names are read from the file's header."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    directory = Path(path)
    if (directory / SAFETENSORS_WEIGHTS_NAME).is_file():
        from safetensors import safe_open

        name = SAFETENSORS_WEIGHTS_NAME
        with safe_open(str(directory / name), framework="pt") as f:
            names = list(f.keys())
    elif (directory / WEIGHTS_NAME).is_file():
        import torch

        name = WEIGHTS_NAME
        names = list(torch.load(directory / name, map_location="cpu", weights_only=True))
    else:
        # (peft would look for the directory's name on a model hub)
        raise AdapterWeightsError(
            f"no {SAFETENSORS_WEIGHTS_NAME} (or {WEIGHTS_NAME}) in it: a peft adapter directory holds its "
            "weights beside adapter_config.json; save the adapter with peft's save_pretrained"
        )
    foreign = sorted(n for n in names if not any(part.startswith("lora_") for part in n.split(".")))
    if foreign:
        raise AdapterWeightsError(
            f"tensors in {name} that are not LoRA weights: {len(foreign)} ({_quote(foreign)}); peft would "
            "write them over the base model's weights of the same names, which every adapter and the base "
            "share; save only the adapter, with peft's save_pretrained"
        )
    return name


class LoadResult(Protocol):
    """What peft's `load_adapter` returns (torch's incompatible keys of the load)."""

    @property
    def missing_keys(self) -> Sequence[str]: ...

    @property
    def unexpected_keys(self) -> Sequence[str]: ...


def check_coverage(model: torch.nn.Module, internal: str, weights: str, result: LoadResult) -> None:
    """Refuse a load (AdapterWeightsError) whose file left some of the adapter's weights as peft
    initialised them (B = 0: those modules compute what the base does), or held weights that
    belong to none of its modules (a file of another adapter, or renamed). `result` is what
    peft's load_adapter returned: the missing and unexpected names, the former of every adapter."""

    def saved_name(key: str) -> str:  # a name as the adapter's file spells it
        return ".".join(p for p in key.removeprefix("base_model.model.").split(".") if p != internal)

    mine = [n for n, _ in model.named_parameters() if internal in n.split(".")]
    missing = sorted(saved_name(k) for k in result.missing_keys if internal in k.split("."))
    unexpected = sorted(saved_name(k) for k in result.unexpected_keys)
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} of its {len(mine)} LoRA weights are missing from {weights} ({_quote(missing)})"
        )
    if unexpected:
        problems.append(
            f"tensors in {weights} that belong to none of its LoRA modules: {len(unexpected)} "
            f"({_quote(unexpected)})"
        )
    if problems:
        raise AdapterWeightsError(
            "its weights do not fit its adapter_config.json: "
            + "; ".join(problems)
            + "; save the adapter with peft's save_pretrained, from a model with the same LoRA settings"
        )
