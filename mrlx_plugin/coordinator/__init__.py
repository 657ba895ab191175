"""The coordinator: a small durable HTTP service that carries one agent's training samples from the
job that produced them to the job that trains on them, and keeps the jobs' weight versions in step.

- `wire`: the binary batch frame (packed token ids, loss masks and log-probs) and `QueueItem`;
- `storage`: the SQLite store (WAL, one writer thread) behind the queues, leases and versions;
- `server`: the aiohttp service and its command line (`mrlx coordinator`);
- `client`: the async client that rollout code calls;
- `bench`: the end-to-end throughput and wake-up latency benchmark.
"""

from __future__ import annotations

from mrlx_plugin.coordinator.wire import (
    QueueItem,
    decode_items,
    encode_items,
    item_from_sample,
    sample_from_item,
)

__all__ = ["QueueItem", "decode_items", "encode_items", "item_from_sample", "sample_from_item"]
