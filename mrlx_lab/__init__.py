"""The lab of mrlx_plugin: what is not the product but ships beside it in the same wheel.

- `demos/`: `mrlx demo` (two small models co-train on a CPU; `--adapters`: as two LoRA adapters of
  one model), `--tools` and `--research` (agent-code examples trained on a CPU), and their kit;
- `examples/`: the agent-code examples the demos and benchmarks run (tool_lookup, research_pair,
  pipeline_as_code), installed so that they run from a wheel outside any checkout;
- `bench/`: `mrlx bench NAME`, benchmarks that print a table and write JSON;
- `stub_engine/`: `mrlx stub-engine`, a model-free SGLang-protocol responder (a test fake for the
  benchmarks and the fault tests), and `start_stub_engine`;
- `procstat`: what /proc says of a process (memory, CPU time, open files);
- `commands`: the commands the lab adds to `mrlx`, registered as entry points (group
  `mrlx_plugin.commands`).

The lab imports the product (`mrlx_plugin`); the product never imports the lab.
"""
