"""The `mrlx` command (`main`) and its subcommands that are not services: `check` (validate configs
and reach every URL) and `rollout` (`run_episodes`: run episodes against engines)."""
