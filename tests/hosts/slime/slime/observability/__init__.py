"""Fake of slime.observability (see the package docstring)."""
