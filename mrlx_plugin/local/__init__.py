"""The embedded default for machines without a GPU: the same plugin code, end to end on a CPU.

- `engine/`: `mrlx engine`, an HTTP server speaking SGLang's protocol, backed by a small model on
  the CPU, batching concurrent requests; the real `sglang-router` may sit in front of it;
- `trainer/`: one agent's slime job on a CPU (`python -m mrlx_plugin.local.trainer`), calling the
  plugin's rollout functions as slime does, with the stand-in host it and `mrlx rollout --local`
  use (`trainer/fake_host.py`);
- `model`: tiny causal language models and byte-level tokenizers built locally from a config
  (nothing is downloaded) and saved so the normal `from_pretrained` path loads them, for the
  engine and the trainer alike;
- `services`: starting engines, routers and the coordinator, each a process of its own.

The demos, the benchmarks and the stub engine that use these live in the lab (`mrlx_lab`), which
this package never imports.

Importing this package imports neither torch nor transformers; the modules that need them do.
"""
