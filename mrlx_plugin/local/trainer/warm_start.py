"""The supervised warm-start (format only, optional): cross-entropy on the assistant messages of
a JSON-lines file of conversations, before any RL step. The demos warm-start their models with it
too."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mrlx_plugin.local.trainer.loss import trainable_parameters
from mrlx_plugin.local.trainer.records import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mrlx_plugin.local.model import Policy


def warm_start(
    model: Policy, tokenizer: PreTrainedTokenizerBase, path: str, steps: int, lr: float, batch: int, seed: int
) -> list[float]:
    """Cross-entropy on the assistant messages of `path` for `steps` steps; returns the losses."""
    import torch

    rows = read_rows(Path(path))
    rng = random.Random(seed)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        chosen = [cast("list[dict[str, str]]", rng.choice(rows)["messages"]) for _ in range(batch)]
        ids, labels = [], []
        for messages in chosen:
            prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            full = prompt + messages[-1]["content"] + tokenizer.eos_token
            p_ids = tokenizer.encode(prompt, add_special_tokens=False)
            f_ids = tokenizer.encode(full, add_special_tokens=False)
            ids.append(f_ids)
            labels.append([-100] * len(p_ids) + f_ids[len(p_ids) :])
        longest = max(map(len, ids))
        x = torch.tensor([i + [0] * (longest - len(i)) for i in ids])
        y = torch.tensor([lab + [-100] * (longest - len(lab)) for lab in labels])
        attention = (torch.arange(longest)[None, :] < torch.tensor([len(i) for i in ids])[:, None]).long()
        loss = model(input_ids=x, attention_mask=attention, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
