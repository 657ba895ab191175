"""The embedded engine: `mrlx engine` (`python -m mrlx_plugin.local.engine`), an HTTP server
speaking SGLang's protocol, backed by a small transformers model on the CPU.

It stands in for an SGLang engine where there is no GPU (CI, a laptop), so the plugin's rollout
code runs unchanged end to end. Its parts:
- `server`: `EngineServer`, the HTTP endpoints (the aiohttp event loop parses, validates, answers);
- `requests`: the request models (SGLang's field names, defaults and refusals);
- `batcher`: `BatchWorker`, the thread that owns the model and generates (continuous batching,
  log-probs, sampling, weight and adapter swaps);
- `jobs`: what passes between the two (a sequence to generate, an update, their answers);
- `adapters`: which LoRA adapters it serves, and the checks of an adapter's files;
- `router`: the real `sglang-router`'s command line, and registering an engine with it;
- `command`: the command line, serving until SIGTERM/SIGINT.

Importing this package imports neither torch nor transformers.
"""
