"""The `mrlx` command (`main`), the commands it offers (`commands`: its own, and those installed
packages add through entry points), and its subcommands that are not services: `check` (validate
configs and reach every URL) and `rollout` (`run_episodes`: run episodes against engines)."""
