"""Stands in for `miles.utils.tracking_utils` (the package of Miles' metric backends)."""
