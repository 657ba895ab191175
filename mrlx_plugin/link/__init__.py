"""The multi-model link: what one job of a multi-model run does to stay in step with the others.

- `outbox`: the initiator's side: other agents' samples out (`PeerOutbox`), the staleness barrier;
- `responder`: the responder's side: a step's groups leased, acknowledged once saved (`Responder`);
- `codec`: a sample as a queue item and back, and the ABORTED filler that stands in for one;
- `limits`: what an agent's model can take (vocabulary, sequence length);
- `save_rules`: slime's checkpoint schedule, which tells a responder what it may acknowledge;
- `job`: what both sides set up alike (the coordinator client, the queue's room for a step);
- `client`: the async client of the coordinator service;
- `wire`: the protocol shared with the coordinator service (the batch frame);
- `item_checks`: a queued item's checks as a training sample (what the coordinator refuses);
- `auth`: signed requests and proved answers (the run's token never travels), and the token.

It uses only `core`; the coordinator service (`mrlx_plugin.coordinator`) imports only `wire`,
`item_checks` and `auth`.
"""
