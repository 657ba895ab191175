"""A hook module as a user writes one: a file in a repository of their own, put on sys.path."""

from __future__ import annotations


def write_hook_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """Write `name`.py (with `hookimpl`, `asyncio` and `math` imported) under tmp_path/user_repo and
    make it importable; return the module name for `mrlx.plugins`. Give each test its own name:
    an imported module stays in sys.modules."""
    repo = tmp_path / "user_repo"
    repo.mkdir(exist_ok=True)
    (repo / f"{name}.py").write_text("import asyncio, math\nfrom mrlx_plugin import hookimpl\n\n" + source)
    monkeypatch.syspath_prepend(str(repo))
    return name
