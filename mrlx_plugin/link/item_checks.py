"""The checks of a queued item as a training sample, on a scanned frame (`wire.scan_frame`): what
the coordinator refuses a commit for (422), naming the item's key and the field. Array values are
checked in place (views of the frame), a batch's arrays at once."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from mrlx_plugin.core.values import LOG_PROB_EPSILON, MIN_LOG_PROB, JSONObject
from mrlx_plugin.link.wire import SAMPLE_STATUSES, FrameView, RecordMeta, RecordView, WireError


def validate_record(record: RecordView) -> None:
    """Check one scanned item as a training sample; raises `WireError` naming the key and field.

    Rules: 0 < response_length <= len(tokens); one loss-mask value (0 or 1) and one log-prob
    (finite, <= LOG_PROB_EPSILON) per response token; token ids >= 0; `fields.reward` a finite
    number (or a JSON object, for hosts that pick a reward key); known sample fields of the right type.
    """
    meta = record.meta
    where = f"item {meta['key']!r}"
    _check_lengths(meta, where)
    batch, row = record.batch, record.row
    tokens = _row_values(batch.column(6), row)
    if tokens.size and tokens.min() < 0:
        raise WireError(f"{where}: tokens hold a negative id ({int(tokens.min())})")
    _check_log_probs(_row_values(batch.column(8), row), where)
    _check_mask(_row_values(batch.column(7), row), where)
    _check_fields(record.fields(), where)


def validate_frame(frame: FrameView) -> None:
    """`validate_record` for every item, with the array checks done once over all of a batch's
    values (a bad value is then traced to its item)."""
    for record in frame.records:
        _check_lengths(record.meta, f"item {record.meta['key']!r}")
    by_batch: dict[int, list[RecordView]] = {}
    for record in frame.records:
        by_batch.setdefault(id(record.batch), []).append(record)
    for records in by_batch.values():
        batch = records[0].batch
        ok = True
        for index, bad in (
            (6, lambda v: v.min() < 0),
            (8, lambda v: not np.isfinite(v).all() or v.max() > LOG_PROB_EPSILON or v.min() < MIN_LOG_PROB),
            (7, lambda v: v.max() > 1),
        ):
            column = batch.column(index)
            offsets = column.offsets.to_numpy()
            values = column.values.to_numpy()[offsets[0] : offsets[-1]]
            if values.size and bad(values):
                ok = False
        if not ok:
            for record in records:
                validate_record(record)
    for record in frame.records:
        _check_fields(record.fields(), f"item {record.meta['key']!r}")  # one item's fields at a time


def _row_values(column: pa.ListArray, row: int) -> np.ndarray:
    offsets = column.offsets.to_numpy()
    return column.values.to_numpy()[offsets[row] : offsets[row + 1]]


def _check_lengths(meta: RecordMeta, where: str) -> None:
    n_tokens = meta["n_tokens"]
    response_length = meta["response_length"]
    if not 0 < response_length <= n_tokens:
        raise WireError(
            f"{where}: response_length must be in [1, len(tokens)={n_tokens}], got {response_length}"
        )
    if meta["n_loss_mask"] != response_length:
        raise WireError(
            f"{where}: loss_mask has {meta['n_loss_mask']} entries but response_length is {response_length}"
            " (one 0/1 per response token)"
        )
    if meta["n_log_probs"] != response_length:
        raise WireError(
            f"{where}: rollout_log_probs has {meta['n_log_probs']} entries but response_length is "
            f"{response_length} (one log-prob per response token)"
        )


def _check_log_probs(log_probs: np.ndarray, where: str) -> None:
    if not np.isfinite(log_probs).all():
        raise WireError(f"{where}: rollout_log_probs hold a NaN or infinite value")
    if log_probs.size and log_probs.max() > LOG_PROB_EPSILON:
        raise WireError(
            f"{where}: rollout_log_probs hold a positive value ({float(log_probs.max())}); log-probs are <= 0"
        )
    if log_probs.size and log_probs.min() < MIN_LOG_PROB:
        raise WireError(
            f"{where}: rollout_log_probs hold {float(log_probs.min())}, below {MIN_LOG_PROB:g}: no model "
            "samples such a token, and a loss over it is infinite"
        )


def _check_mask(mask: np.ndarray, where: str) -> None:
    if mask.size and mask.max() > 1:
        raise WireError(f"{where}: loss_mask holds {int(mask.max())}; only 0 and 1 are allowed")


def _check_fields(fields: JSONObject, where: str) -> None:
    if "reward" not in fields:
        raise WireError(f"{where}: fields.reward is missing; samples are queued once their reward is known")
    reward = fields["reward"]
    if isinstance(reward, bool) or not (
        (isinstance(reward, (int, float)) and math.isfinite(reward)) or isinstance(reward, dict)
    ):
        raise WireError(
            f"{where}: fields.reward must be a finite number (or a JSON object), got {reward!r}"
            " (NaN and infinity arrive as null)"
        )
    status = fields.get("status")
    if status is not None and status not in SAMPLE_STATUSES:
        raise WireError(f"{where}: fields.status must be one of {list(SAMPLE_STATUSES)}, got {status!r}")
    versions = fields.get("weight_versions")
    if versions is not None and not (
        isinstance(versions, list) and all(isinstance(v, str) for v in versions)
    ):
        raise WireError(f"{where}: fields.weight_versions must be a list of strings")
    for name in ("group_index", "index", "rollout_id"):
        value = fields.get(name)
        if value is not None and not _is_int(value):
            raise WireError(f"{where}: fields.{name} must be an integer or null, got {value!r}")
    prompt = fields.get("prompt")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise WireError(f"{where}: fields.prompt must be a string or a list of messages")
    response = fields.get("response")
    if response is not None and not isinstance(response, str):
        raise WireError(f"{where}: fields.response must be a string")
    metadata = fields.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise WireError(f"{where}: fields.metadata must be a JSON object")
    remove = fields.get("remove_sample")
    if remove is not None and not isinstance(remove, bool):
        raise WireError(f"{where}: fields.remove_sample must be true or false")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
