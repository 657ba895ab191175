"""The rows a `BatchWorker` decodes together: their shared KV cache, attention mask and next input
tokens (`RunningBatch`), with selecting rows (finished ones leave) and merging batches (newly
prefilled rows join), on the KV-cache classes of every transformers version it supports.

torch is imported where a batch is built, not at import time (see `batcher.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache

from mrlx_plugin.local.engine.jobs import Job


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Any: a transformers cache, whose attributes differ across the versions supported
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))


def make_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    from transformers import DynamicCache

    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(tuple(tensors))
    return DynamicCache(ddp_cache_data=tensors)


def left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    import torch

    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)


@dataclass
class RunningBatch:
    """The running rows: their KV cache, attention mask and next input token/position."""

    jobs: list[Job]
    cache: DynamicCache
    mask: torch.Tensor  # (B, L) long; 0 = left padding
    next_tokens: torch.Tensor  # (B,) sampled, not yet fed to the model
    next_pos: torch.Tensor  # (B,) position of next_tokens

    def select(self, keep: list[int]) -> RunningBatch:
        import torch

        idx = torch.tensor(keep, dtype=torch.long)
        tensors = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in cache_tensors(self.cache)]
        mask = self.mask.index_select(0, idx)
        # Drop the left columns no remaining row attends to (a long row that left the batch
        # leaves that much padding behind, which every later step would pay for).
        used = mask.sum(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        if start > 0:
            tensors = [(k[:, :, start:, :], v[:, :, start:, :]) for k, v in tensors]
            mask = mask[:, start:]
        return RunningBatch(
            [self.jobs[i] for i in keep],
            make_cache(tensors),
            mask,
            self.next_tokens.index_select(0, idx),
            self.next_pos.index_select(0, idx),
        )

    def merge(self, other: RunningBatch) -> RunningBatch:
        import torch

        la, lb = self.mask.shape[1], other.mask.shape[1]
        width = max(la, lb)
        tensors = [
            (
                torch.cat([left_pad(ka, width - la, 2), left_pad(kb, width - lb, 2)]),
                torch.cat([left_pad(va, width - la, 2), left_pad(vb, width - lb, 2)]),
            )
            for (ka, va), (kb, vb) in zip(cache_tensors(self.cache), cache_tensors(other.cache))
        ]
        mask = torch.cat([left_pad(self.mask, width - la, 1), left_pad(other.mask, width - lb, 1)])
        return RunningBatch(
            self.jobs + other.jobs,
            make_cache(tensors),
            mask,
            torch.cat([self.next_tokens, other.next_tokens]),
            torch.cat([self.next_pos, other.next_pos]),
        )
