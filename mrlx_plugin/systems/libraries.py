"""Games of an optional library (OpenSpiel, TextArena): their names, and importing the library with a
message that names the extra to install when it is missing."""

from __future__ import annotations

import difflib
import importlib
from types import ModuleType

OPENSPIEL, TEXTARENA = "openspiel:", "textarena:"
DISTRIBUTION = "mrlx-plugin"


class LibraryMissing(ImportError):
    """The library a game or a helper needs is not installed; the message names the extra."""


def is_library_game(name: str) -> bool:
    """Whether `name` is one the adapters build (`openspiel:...`, `textarena:...`)."""
    return name.startswith((OPENSPIEL, TEXTARENA))


def import_library(module: str, library: str, extra: str, wanted_by: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise LibraryMissing(
            f"{wanted_by} needs {library} (module {module}), which cannot be imported here ({exc}); "
            f"install it with: pip install '{DISTRIBUTION}[{extra}]'"
        ) from exc


def unknown_game(what: str, name: str, known: list[str], how: str) -> ValueError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(f"mrlx.game.name: {what} has no game {name!r}{hint}; list its games with: {how}")
