"""The host's side of a test: an `args` object shaped exactly like slime's, and its samples."""

from __future__ import annotations

import argparse
from typing import Any

from mrlx_plugin.core.host import Sample
from mrlx_plugin.local.fake_host import add_host_arguments, host_args, sampling_params, set_router


def slime_args(
    router_url: str | None, tokenizer: str, mrlx: dict[str, Any], **flags: Any
) -> argparse.Namespace:
    """What slime passes after parsing its flags and applying `--custom-config-path` (key `mrlx`)."""
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    ns = parser.parse_args([])
    ns.hf_checkpoint = tokenizer
    args = host_args(ns, None)
    if router_url:
        set_router(args, router_url)
    args.mrlx = mrlx
    for key, value in flags.items():
        setattr(args, key, value)
    return args


def params(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    p = sampling_params(args)
    p.update(overrides)
    return p


def group(index: int, n: int, prompt: Any = "What is 40 + 2?", label: str = "42") -> list[Sample]:
    """One prompt group as slime's data source hands it out: n copies, group and sample indices set."""
    return [Sample(group_index=index, index=index * n + j, prompt=prompt, label=label) for j in range(n)]
