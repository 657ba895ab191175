"""Fake of slime.rollout (see the package docstring)."""
