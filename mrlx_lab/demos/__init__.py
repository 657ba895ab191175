"""The demos, `mrlx demo` (`cli`): each trains small models built on this machine, on a CPU, through
the plugin's real rollout functions and embedded trainers, and reports a plot, metrics and a table.

- `co_training`: `mrlx demo`, two models co-train through the full multi-model loop (the
  coordinator, a trainer per agent); `--adapters`: as two LoRA adapters of one base model;
- `long_tail`: `mrlx demo --long-tail`, those two agents on a long-tail workload, synchronous
  against fully asynchronous rollouts;
- `tools`: `mrlx demo --tools`, one agent learns to look an answer up with a tool call
  (`mrlx_lab.examples.tool_lookup`);
- `research`: `mrlx demo --research`, a planner delegates to a searcher with a search tool, two
  models (`mrlx_lab.examples.research_pair`);
- `kit`: what they share (options, services and trainers, following a run, the report).
"""
