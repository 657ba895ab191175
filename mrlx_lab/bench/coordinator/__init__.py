"""Benchmark of the coordinator: training steps end to end, wake-up latency, and a baseline.

Three measurements, side by side in one run (every party in its own process):

1. Throughput: a producer process commits a step of `samples` samples x `tokens` tokens (token ids,
   loss mask and log-probs as Python lists, response = half the tokens) to the coordinator
   (SQLite, synchronous=FULL by default) while a consumer process leases, decodes to Python lists
   and acks. The clock starts when the producer calls `commit` (its samples are Python lists, so
   encoding is inside) and stops when the consumer has decoded the last sample of the step. A
   checksum over every token id, mask value and log-prob proves nothing changed on the way.
   `steps` steps run one after another with `step_gap_s` of idle time between them, as between
   training steps; the first step pays for cold caches and fresh memory in every process, the
   last one shows the steady state. Both are reported.
2. Wake-up latency: a waiter process long-polls `wait_version`; a reporter process reports the
   awaited version ~20 ms later; latency = waiter's receive time - reporter's send time.
3. Baseline (`baseline`): a plain in-memory HTTP queue (a minimal aiohttp app in
   its own process, part of this benchmark only) taking one JSON item per request from 16
   concurrent producer tasks and handing one JSON item per request to 16 concurrent consumer
   tasks (stdlib json, as a plain client would use). The baseline server keeps request bodies as
   bytes and returns them unchanged, the most favourable plain queue. Same steps, clock and
   checksum.

`python -m mrlx_lab.bench.coordinator` (or the `mrlx` CLI) prints a table and writes JSON. The parts:
`steps` (a step's samples, checksum, release and throughput), `service` (the coordinator, its
producer and consumer, the wake-up latency), `baseline`, `run` (the run, the report, the table).
"""
