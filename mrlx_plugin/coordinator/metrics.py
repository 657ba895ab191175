"""The coordinator's Prometheus metrics: every counter and gauge /metrics serves, by name, with
its help text and labels, in a registry of the server's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (one per server)."""

    COUNTERS = {
        "mrlx_coordinator_items_enqueued_total": ("items accepted into a queue", ("consumer",)),
        "mrlx_coordinator_items_duplicate_total": (
            "items re-committed under a known key (no-op)",
            ("consumer",),
        ),
        "mrlx_coordinator_items_leased_total": (
            "items handed out under a lease (redeliveries included)",
            ("consumer",),
        ),
        "mrlx_coordinator_items_redelivered_total": (
            "items handed out again after a lease expired",
            ("consumer",),
        ),
        "mrlx_coordinator_items_acked_total": ("items acked (done for good)", ("consumer",)),
        "mrlx_coordinator_items_dead_lettered_total": (
            "items set aside, never delivered again (reason: deliveries, or rejected by the consumer)",
            ("consumer", "reason"),
        ),
        "mrlx_coordinator_wait_timeouts_total": ("long polls that ended without their condition", ("kind",)),
        "mrlx_coordinator_requests_total": ("HTTP requests by endpoint and status", ("endpoint", "status")),
    }
    GAUGES = {
        "mrlx_coordinator_uptime_seconds": ("seconds since the coordinator started", ()),
        "mrlx_coordinator_queue_items": (
            "unacked items per consumer queue: queued (incl. incomplete groups and expired leases) or leased",
            ("consumer", "state"),
        ),
        "mrlx_coordinator_queue_ready_groups": ("complete groups waiting for a lease", ("consumer",)),
        "mrlx_coordinator_queue_dead_items": (
            "items set aside per consumer queue (dead-lettered: never delivered again)",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_incomplete_groups": (
            "groups still waiting for items or a seal",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_oldest_item_age_seconds": (
            "age of the oldest unacked item (0 when empty)",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_ended": ("1 once the producer ended the queue", ("consumer",)),
        "mrlx_coordinator_agent_version": (
            "last weight version reported per agent (-1: none yet)",
            ("agent",),
        ),
        "mrlx_coordinator_agent_last_seen_seconds": (
            "seconds since the agent's last call (-1: never seen)",
            ("agent",),
        ),
        "mrlx_coordinator_waits_in_progress": ("long polls in progress", ("kind",)),
    }

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = {
            name: Counter(name, doc, labels, registry=self.registry)
            for name, (doc, labels) in self.COUNTERS.items()
        }
        self.gauges = {
            name: Gauge(name, doc, labels, registry=self.registry)
            for name, (doc, labels) in self.GAUGES.items()
        }

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        counter = self.counters[name]
        (counter.labels(**labels) if labels else counter).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        gauge = self.gauges[name]
        (gauge.labels(**labels) if labels else gauge).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
