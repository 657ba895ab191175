"""The agent-code examples the demos and benchmarks run, installed with them so that they run from
a wheel outside any checkout. Each is also a plugin module a config can name:

- `tool_lookup`: one agent looks an item's code up with a tool (`mrlx demo --tools`);
- `research_pair`: a planner delegates to a searcher with a search tool (`mrlx demo --research`);
- `long_tail`: a dialogue whose prompts may ask for many rounds (`mrlx demo --long-tail`);
- `pipeline_as_code`: the README's solver -> rewriter -> selector team as agent code
  (`system: pipeline_code`; `mrlx bench agents`);
- `harness`: an unmodified agent CLI (Claude Code or Codex) run once per episode against the
  agent's endpoint, graded on the answer it writes (`system: claude_code_task` or `codex_task`;
  docs/harnesses.md).
"""
