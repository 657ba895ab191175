"""The coordinator's configuration (what `mrlx coordinator`'s options give, see `server`) and the
limits it serves under."""

from __future__ import annotations

from dataclasses import dataclass, field

# What a commit's frame may hold (413 past it), checked while it is read, before any item is unpacked:
# each item costs ~2 KB of objects however few bytes it takes, each record batch ~4 KB. The client
# sends one batch of at most 1024 items; the per-request item limit is also --max-depth when lower.
MAX_COMMIT_ITEMS = 4096
MAX_FRAME_BATCHES = 1024
MAX_FRAME_MESSAGE_BYTES = 64 << 10  # a message's metadata; the schema's holds the frame header
# Bodies above this size are hashed on a worker thread, so the loop keeps serving other calls.
HASH_ON_THREAD_BYTES = 256 << 10
HEARTBEAT_FLUSH_S = 2.0
RETRY_AFTER_S = 1
IDLE_TIMEOUT_S = 30.0  # longer than the client's own keep-alive (15 s), so the client closes first
MAX_CONNECTIONS = 1000
MAX_DELIVERIES = 3


@dataclass
class CoordinatorConfig:
    db: str
    run_id: str
    agents: list[str]
    host: str = "127.0.0.1"
    port: int = 18888
    token: str | None = field(default=None, repr=False)
    # A second, read-only secret for GET /metrics alone (a Prometheus scraper sends it as a bearer
    # token; it cannot sign requests). It opens nothing else.
    metrics_token: str | None = field(default=None, repr=False)
    max_depth: int = 65536
    max_request_mb: float = 512.0
    port_file: str | None = None
    synchronous: str = "full"
    max_db_mb: float | None = None
    max_deliveries: int = MAX_DELIVERIES
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
