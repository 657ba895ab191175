"""The embedded default for machines without a GPU.

- `model`: tiny causal language models and byte-level tokenizers built locally from a config
  (nothing is downloaded) and saved so the normal `from_pretrained` path loads them;
- `engine`: `mrlx engine`, an HTTP server speaking SGLang's protocol, backed by such a model on
  the CPU, batching concurrent requests; the real `sglang-router` may sit in front of it;
- `stub_engine`: a model-free responder of the same protocol, for benchmarks and fault tests.

Importing this package imports neither torch nor transformers; the modules that need them do.
"""
