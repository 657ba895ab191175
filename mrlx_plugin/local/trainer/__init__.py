"""The embedded trainer: `python -m mrlx_plugin.local.trainer`, one agent's slime job on a CPU.

It plays the host's part for one agent as slime's synchronous loop does (`loop`, whose docstring
shows the loop), calling the plugin's rollout functions the way slime calls them. Its parts:
- `loop`: the job, top to bottom; `flags`: its command line (slime's flag names);
- `loss`: PPO-clip in slime's shape and the learning-rate schedule; `warm_start`: the optional
  supervised, format-only warm-start;
- `weights`: checkpoints, and pushing them to the agent's engines; `evaluation`: held-out episodes
  (slime's --eval-interval); `records`: its JSON-lines files (metrics.jsonl, samples.jsonl);
- `fake_host`: the stand-in of the host's side (args, the data source, the default rollout),
  which `mrlx rollout --local` uses too; `tasks`: built-in prompts; `settings`: `mrlx.trainer`.

Importing this package imports neither torch nor transformers.
"""
