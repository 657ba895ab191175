"""The plugin core, what the host's rollout process runs: settings, the host adapters, episodes,
transcripts, tokenizers, the engine client, metrics, the one way to start and stop a process,
and the one deadline-and-backoff helper.

No servers, no torch, no coordinator: every module here imports only the standard library, the
host's own libraries and other modules of `core`.
"""
