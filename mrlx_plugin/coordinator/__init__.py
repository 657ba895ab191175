"""The coordinator service: a small durable HTTP service that carries one agent's training samples
from the job that produced them to the job that trains on them, and keeps the jobs' weight
versions in step (`mrlx coordinator`). It shares only the wire protocol (`mrlx_plugin.link.wire`)
with the plugin.

- `storage`: the SQLite store (WAL, one writer thread) behind the queues, leases and versions;
- `server`: the aiohttp service and its command line.
"""
