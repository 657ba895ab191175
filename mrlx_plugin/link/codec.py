"""A sample as the coordinator carries it, and back.

The producer's job turns each sample of another job's agent into a `QueueItem`
(`item_from_sample`); the consumer's job turns each item it leases back into a Sample for its
trainer (`sample_from_item`). `filler_sample` makes the ABORTED sample that stands in, on either
side, for one that cannot be trained, so that a group and a step keep their sample counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from mrlx_plugin.core.host import HostSample, Sample, Status
from mrlx_plugin.core.values import JSONObject
from mrlx_plugin.link.wire import SAMPLE_FIELDS, QueueItem, as_list


def item_from_sample(
    sample: HostSample, *, key: str, group: str, group_size: int, producer: str, step: int
) -> QueueItem:
    """A `QueueItem` carrying `sample` (the host's Sample or ours) to the consumer's queue.

    The arrays are taken as they are (no copy); the scalar and JSON attributes named in
    `SAMPLE_FIELDS` go into `fields` (status as its string value).
    """
    fields: JSONObject = {}
    for name in SAMPLE_FIELDS:
        value = getattr(sample, name, None)
        if value is None:
            continue
        if name == "status":
            value = getattr(value, "value", value)
        fields[name] = value
    return QueueItem(
        key=key,
        group=group,
        group_size=group_size,
        producer=producer,
        step=step,
        tokens=sample.tokens,
        response_length=sample.response_length,
        loss_mask=sample.loss_mask if sample.loss_mask is not None else (),
        rollout_log_probs=sample.rollout_log_probs if sample.rollout_log_probs is not None else (),
        fields=fields,
    )


def sample_from_item(item: QueueItem) -> HostSample:
    """The host's Sample (or our stand-in) for a decoded item, ready for the consumer's trainer.

    Fields the Sample class does not declare are set as attributes, so nothing the producer sent
    is dropped. Lists are handed over without a copy.
    """
    sample = Sample()
    value: object  # a field's JSON value, or what the Sample holds for it
    for name, value in item.fields.items():
        if name == "status":
            value = Sample.Status(value)
        elif name == "metadata":
            value = dict(cast(JSONObject, value))
        setattr(sample, name, value)
    sample.tokens = as_list(item.tokens)
    sample.response_length = item.response_length
    sample.loss_mask = as_list(item.loss_mask)
    sample.rollout_log_probs = as_list(item.rollout_log_probs)
    return sample


def filler_sample(
    agent: str,
    *,
    group_index: int | str | None,
    index: int | str | None,
    rollout_id: int | str | None,
    reason: str,
    metadata: Mapping[str, object] | None = None,
    pad_id: int = 0,
) -> HostSample:
    """An ABORTED sample that trains nothing and that any model can take: reward 0.0, zero loss
    mask, `remove_sample`, two token ids (`pad_id`), no weight version. It stands in for a sample
    that cannot be trained, so that a step keeps its sample count."""
    sample = Sample()
    for name, value in (
        ("group_index", group_index),
        ("index", index),
        ("rollout_id", rollout_id),
        ("prompt", ""),
        ("response", ""),
        ("label", None),
    ):
        setattr(sample, name, value)
    sample.tokens = [pad_id, pad_id]
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.weight_versions = []
    sample.reward = 0.0
    sample.status = Status.ABORTED
    sample.remove_sample = True
    meta = dict(cast("dict[str, object]", (metadata or {}).get("mrlx") or {}))
    meta.update(agent=agent, aborted=True)
    meta.setdefault("filler", reason)
    sample.metadata = {**(metadata or {}), "mrlx": meta}
    return sample
