"""The built-in solver -> rewriter -> selector pipeline, written as agent code (see hooks.py)."""
