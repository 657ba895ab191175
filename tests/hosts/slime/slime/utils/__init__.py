"""Fake of slime.utils (see the package docstring)."""
