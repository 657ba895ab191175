"""The coordinator service (aiohttp): durable per-agent sample queues, leases and acks, and the
weight-version registry that keeps two training jobs within a staleness bound.

One coordinator serves one run (`--run-id`) and the agents named at start (`--agents`). Routes,
all under /v1 except health, metrics and the OpenAPI document:

    GET  /health                                       no auth: {"ok": true}; signed: also the status,
                                                       run id, uptime and database path
    GET  /metrics                                      Prometheus text
    GET  /openapi.json                                 no auth: OpenAPI 3 description of all routes (signed:
                                                       with the run id and agents as the path values)
    GET  /v1/runs/{run}                                agents (version, last seen) and queue depths
    POST /v1/runs/{run}/queues/{consumer}/commit       body: a wire frame of items (see `wire`)
    POST /v1/runs/{run}/queues/{consumer}/lease        JSON in, wire frame out (lease id in its header)
    POST /v1/runs/{run}/queues/{consumer}/ack          {"lease_id"}
    POST /v1/runs/{run}/queues/{consumer}/ack_through  {"step"}: every group of that producer step or an
                                                       earlier one is done (a durable watermark)
    POST /v1/runs/{run}/queues/{consumer}/release      {}: hand back the consumer's leases now (its
                                                       restarted process takes a dead one's over)
    POST /v1/runs/{run}/queues/{consumer}/reject       {"group", "reason"}: set a group aside now
    POST /v1/runs/{run}/queues/{consumer}/extend       {"lease_id", "lease_s"}
    POST /v1/runs/{run}/queues/{consumer}/seal         {"group", "size"}
    POST /v1/runs/{run}/queues/{consumer}/end          {}
    GET  /v1/runs/{run}/queues/{consumer}              depth, ready groups, ended
    POST /v1/runs/{run}/agents/{agent}/heartbeat       {"pid"?, "host"?}
    POST /v1/runs/{run}/agents/{agent}/version         {"version"}
    GET  /v1/runs/{run}/agents/{agent}/version
    POST /v1/runs/{run}/agents/{agent}/wait_version    {"min_version", "timeout_s"?} (long poll)

A group leased `--max-deliveries` times and never acknowledged, or rejected by its consumer, is set
aside (dead-lettered): kept in the database, never delivered again, reported in lease answers
(`dead`) so that the consumer can keep its step's shape, and counted in /metrics.

With a token, every call but /health and /openapi.json must be signed with keys derived from it
(the token never travels; `mrlx_plugin.link.auth` has the scheme), and every answer to a signed
request carries a proof that the coordinator holds the token (X-Mrlx-Proof). Clients name
themselves with `X-Mrlx-Agent`, `X-Mrlx-Pid`, `X-Mrlx-Host`; any such call counts as a heartbeat.
Errors are JSON `{"error": message}` with the status saying what kind (401, 404, 409, 413, 422,
429 with Retry-After, 503/507 when the database cannot be written).

It shares only the wire protocol (`mrlx_plugin.link.wire`, `link.item_checks`) and the request
signing (`link.auth`) with the plugin. Its modules:

- `server`: the command line (`mrlx coordinator`) and serving until interrupted;
- `config`: the configuration the options give, and the limits it serves under;
- `service`: the aiohttp application (`Coordinator`), its middlewares, health, agents and metrics;
- `queues`: the queue routes (commits, leases, acks, watermarks, seals, ends);
- `state`: what the service keeps between requests, and the helpers every handler shares;
- `access`: signed requests checked and answers proved;
- `bodies`: the JSON request bodies and their 422 messages;
- `routes`: every route, its handler and what /openapi.json says of it;
- `openapi`: the OpenAPI document;
- `metrics`: the Prometheus metrics;
- `connections`: how many connections are held open, and for how long an idle one;
- `storage`: the store behind the queues, leases and versions (`CoordinatorStore`);
- `commits`: what one commit writes, step by step;
- `database`: the SQLite file under the store (WAL, one writer thread, its transactions).
"""
