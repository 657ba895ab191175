"""An agent harness trained as it is: the unmodified Claude Code or Codex CLI runs once per episode
against its agent's endpoint, and is graded on the answer it leaves (see hooks.py)."""
