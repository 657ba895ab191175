"""The multi-model link: what one job of a multi-model run does to stay in step with the others.

- `peers`: the initiator's outbox and barrier, and the responder's take/acknowledge side;
- `client`: the async client of the coordinator service;
- `wire`: the protocol shared with the coordinator service (the batch frame, the token).

It uses only `core`; the coordinator service (`mrlx_plugin.coordinator`) imports only `wire`.
"""
