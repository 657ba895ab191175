"""Fake of slime.ray (see the package docstring)."""
