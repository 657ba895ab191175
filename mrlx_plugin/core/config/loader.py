"""Reading settings: the one parser (`parse_settings`, every problem of a file in one
`ConfigError`), the hardened YAML loader under it (no repeated key, no alias bomb, no nesting past
a limit), where a host leaves the settings (`raw_settings_from_args`: slime's `args.mrlx`, Miles'
`--mrlx-config`, an inline `base64:` config), and the settings that hold either text or the path
of a file (system prompts, chat templates)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TypeVar, cast

import yaml
from pydantic import BaseModel, ValidationError

from mrlx_plugin.core.config.messages import CROSS, TOP_KEY, ConfigError, message_lines
from mrlx_plugin.core.config.schema import Settings, settings_model
from mrlx_plugin.core.config.values import EnvValue, show_value

# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------


T = TypeVar("T")


def _unshared(value: T) -> T:
    """A copy with no container shared: YAML aliases share one dict among places, and leaving a
    bad value out of one place must not change the others."""
    if isinstance(value, dict):
        return cast(T, {k: _unshared(v) for k, v in value.items()})
    if isinstance(value, list):
        return cast(T, [_unshared(v) for v in value])
    return value


def _leave_out(data: dict, loc: tuple) -> bool:
    """Remove the value a pydantic error is about from `data` (a bad list item takes its whole
    list), so that the next pass uses that setting's default. False when nothing was there."""
    loc = loc[1:] if loc[:1] == ("extra",) else loc
    holder, key, node = None, None, data
    for part in (p for p in loc if p != "[key]"):
        if isinstance(node, list):
            break
        if not isinstance(node, dict) or part not in node:
            return False
        holder, key, node = node, part, node[part]
    if holder is None:
        return False
    del holder[key]
    return True


def parse_settings(
    data: object,
    source: str = "config",
    known_systems: set[str] | None = None,
    *,
    sections: Mapping[str, type[BaseModel]],
) -> Settings:
    """Build Settings from the YAML's `mrlx` mapping, with a typed field for each of `sections`
    (see `settings_model`). Raises ConfigError naming every bad key, `source` first.

    The one way settings are read. Whoever builds them names the sections beside the core's:
    those of the systems it registered and the embedded trainer's where it reads that section
    (`mrlx_plugin.settings.job_sections` gives them); `{}` reads the core's sections alone.
    `known_systems`: the names a config may select (None: not checked).

    pydantic stops at the first bad value of each place and checks between sections only once
    every value is good; to report every problem at once, each pass leaves the bad values out
    (their defaults apply, which are good) and validates again, until only the checks between
    sections are left."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {TOP_KEY}: got {type(data).__name__}; expected a mapping of settings")
    root = settings_model(sections)
    problems: list[str] = []
    context = {"known_systems": known_systems}
    copied = False
    while True:
        try:
            settings = root.model_validate(data, context=context)
            break
        except ValidationError as exc:
            found = exc.errors(include_url=False)
        for error in found:
            problems += message_lines(error, root)
        bad = [e["loc"] for e in found if e["type"] != CROSS]
        if not copied:
            data, copied = _unshared(data), True
        if not any([_leave_out(data, loc) for loc in bad]):
            break
    if problems:
        raise ConfigError(f"{source}: " + "\n  ".join([f"{len(problems)} problem(s):", *problems]))
    return settings


# ---------------------------------------------------------------------------------------------
# The YAML loader
# ---------------------------------------------------------------------------------------------

# A settings file is a few levels deep and a few hundred values long. These limits stop a
# malicious or broken file before it costs memory or the stack: anchors and aliases can make a
# few lines stand for billions of values ("billion laughs"), and nesting costs Python frames.
MAX_YAML_DEPTH = 64  # levels of nesting, counted through aliases
MAX_YAML_ALIAS_VALUES = 100_000  # values that aliases repeat, over the whole file


class YamlLimitError(yaml.YAMLError):
    """A YAML file past one of the limits above; `load_yaml` turns it into a ConfigError."""

    def __init__(self, path: list[str], node_or_mark: yaml.Node | yaml.Mark | None, problem: str):
        super().__init__(problem)
        self.key = _yaml_path(path)
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.line = mark.line + 1 if mark is not None else None
        self.problem = problem


def _yaml_path(segments: list[str]) -> str:
    shown = segments if len(segments) <= 8 else segments[:8] + ["..."]
    out = ""
    for seg in shown:
        out += seg if seg.startswith("[") or seg == "..." or not out else "." + seg
    return out or "(the top level)"


def _segment(parent: yaml.Node | None, index: yaml.Node | int | None) -> str:
    if isinstance(parent, yaml.SequenceNode):
        return f"[{index}]"
    if isinstance(index, yaml.ScalarNode):
        return str(index.value)
    return "(a key)" if parent is not None else ""


def _children(node: yaml.Node) -> list[tuple[str, yaml.Node, yaml.Node]]:
    """(path segment, child node, the node whose line names the place) of each child: for a
    mapping's value that is its key, since an alias's node carries the line of its anchor."""
    if isinstance(node, yaml.SequenceNode):
        return [(f"[{i}]", child, child) for i, child in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        out = []
        for key, value in node.value:
            out.append(("(a key)", key, key))
            out.append((str(key.value) if isinstance(key, yaml.ScalarNode) else "(a key)", value, key))
        return out
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases loop, repeat more than MAX_YAML_ALIAS_VALUES values, or
    nest deeper than MAX_YAML_DEPTH. One pass over the node graph, each node once (aliases share
    nodes), without recursion."""
    size: dict[int, int] = {}  # id(node) -> values in it once every alias is written out
    depth: dict[int, int] = {}
    parents: dict[int, int] = {}  # id(node) -> how many places refer to it (more than one: aliased)
    on_stack: set[int] = set()
    stack = [("", root, iter(_children(root)))]
    on_stack.add(id(root))
    while stack:
        _, node, todo = stack[-1]
        for seg, child, where in todo:
            parents[id(child)] = parents.get(id(child), 0) + 1
            if id(child) in on_stack:
                raise YamlLimitError(
                    [s for s, _, _ in stack[1:]] + [seg],
                    where,
                    "an alias refers to a value that contains it (a loop); write the value out",
                )
            if id(child) not in size:
                on_stack.add(id(child))
                stack.append((seg, child, iter(_children(child))))
                break
        else:
            stack.pop()
            on_stack.discard(id(node))
            kids = [child for _, child, _ in _children(node)]
            size[id(node)] = 1 + sum(size[id(c)] for c in kids)
            depth[id(node)] = 1 + max((depth[id(c)] for c in kids), default=0)

    def descend(measure: dict[int, int], stop_at_alias: bool) -> tuple[list[str], yaml.Node]:
        """The path into the biggest (or deepest) child, down to the first alias (or the limit),
        and the last key on it (the line of a node reached through an alias is its anchor's)."""
        path: list[str] = []
        node, key = root, root
        while True:
            kids = _children(node)
            if not kids:
                return path, key
            seg, node, where = max(kids, key=lambda kid: measure[id(kid[1])])
            path.append(seg)
            if where is not node:
                key = where
            if (stop_at_alias and parents.get(id(node), 0) > 1) or len(path) >= MAX_YAML_DEPTH:
                return path, key

    if depth[id(root)] > MAX_YAML_DEPTH:
        path, node = descend(depth, stop_at_alias=False)
        raise YamlLimitError(
            path,
            node,
            f"nested more than {MAX_YAML_DEPTH} levels deep (aliases included); "
            "settings are a few levels deep: flatten it",
        )
    repeated = size[id(root)] - len(size)
    if repeated > MAX_YAML_ALIAS_VALUES:
        path, node = descend(size, stop_at_alias=True)
        raise YamlLimitError(
            path,
            node,
            f"the aliases (*name) of this file repeat {repeated:,} values, "
            f"more than the {MAX_YAML_ALIAS_VALUES:,} allowed (a 'billion laughs' "
            "YAML bomb?); write the values out, or nest fewer aliases",
        )


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one,
    which would silently drop, say, one of two agents with one name), and a document past the
    limits above (before anything is built from it)."""

    def __init__(self, stream: str | bytes | IO[str] | IO[bytes]):
        super().__init__(stream)
        self._path: list[str] = []

    def compose_node(self, parent: yaml.Node | None, index: yaml.Node | int | None) -> yaml.Node | None:
        if parent is not None:
            self._path.append(_segment(parent, index))
        try:
            if len(self._path) > MAX_YAML_DEPTH:
                raise YamlLimitError(
                    list(self._path),
                    self.peek_event().start_mark,
                    f"nested more than {MAX_YAML_DEPTH} levels deep; settings are a few "
                    "levels deep: flatten it",
                )
            return super().compose_node(parent, index)
        finally:
            if parent is not None:
                self._path.pop()

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: the base class merges it
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); YAML would "
                    "keep "
                    "only the last, silently dropping the other: rename or merge them",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | os.PathLike) -> dict:
    """Read a `--custom-config-path` YAML (or Miles' inline `base64:...`) and return its mapping."""
    text = _read_file_arg(str(path))
    where = config_label(path)
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except YamlLimitError as exc:
        line = f"line {exc.line}: " if exc.line is not None else ""
        raise ConfigError(f"{where}: {line}{exc.key}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping with the key '{TOP_KEY}'")
    return data


# ---------------------------------------------------------------------------------------------
# Where a host leaves the settings
# ---------------------------------------------------------------------------------------------


def is_inline(value: str | os.PathLike | None) -> bool:
    """Whether a `--custom-config-path` value is Miles' inline form (`base64:<payload>`), not a path."""
    return str(value or "").startswith("base64:")


def config_label(value: str | os.PathLike) -> str:
    """How messages name a config argument: the path, or a short name for an inline payload."""
    return "--custom-config-path base64:..." if is_inline(value) else str(value)


def config_dir(value: str | os.PathLike | None) -> Path | None:
    """The folder that relative file settings of this config are read from: the YAML file's own
    folder, or None (the working directory) for an inline config or none at all."""
    if not value or is_inline(value):
        return None
    path = Path(value)
    return path.parent if path.is_file() else None


def _read_file_arg(value: str) -> str:
    if is_inline(value):
        import base64
        import binascii

        try:
            return base64.b64decode(value[len("base64:") :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"--custom-config-path base64:...: the payload is not base64 of UTF-8 YAML ({exc}); "
                "encode the YAML file with `base64 -w0 FILE`"
            ) from None
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ConfigError(f"{value}: cannot read the config file ({exc.strerror})") from None


def settings_from_yaml(
    path: str | os.PathLike,
    known_systems: set[str] | None = None,
    *,
    sections: Mapping[str, type[BaseModel]],
) -> Settings:
    """`parse_settings` of a YAML file's `mrlx` key."""
    data = load_yaml(path)
    if TOP_KEY not in data:
        raise ConfigError(
            f"{path}: no top-level '{TOP_KEY}' key; put every plugin setting under '{TOP_KEY}:'"
        )
    return parse_settings(data[TOP_KEY], source=str(path), known_systems=known_systems, sections=sections)


def raw_settings_from_args(args: argparse.Namespace) -> tuple[object, str, Path | None]:
    """The `mrlx` mapping as the host left it on `args`, where it came from (for messages), and the
    folder its relative file settings are read from (see `config_dir`)."""
    value = getattr(args, TOP_KEY, None)
    if isinstance(value, dict):
        source = getattr(args, "custom_config_path", None)
        if source and config_dir(source) is not None:
            # The host has parsed the file already, keeping the last of any repeated key; read
            # it again, strictly, so that a repeated key is an error instead of a silent drop.
            load_yaml(source)
        return value, config_label(source) if source else "args.mrlx", config_dir(source)
    file_arg = getattr(args, "mrlx_config", None) or getattr(args, "custom_config_path", None)
    if file_arg:
        data = load_yaml(file_arg)
        if TOP_KEY not in data:
            raise ConfigError(
                f"{config_label(file_arg)}: no top-level '{TOP_KEY}' key; put every plugin setting under "
                f"'{TOP_KEY}:'"
            )
        return data[TOP_KEY], config_label(file_arg), config_dir(file_arg)
    raise ConfigError(
        "no mrlx settings found: pass --custom-config-path FILE.yaml with a top-level 'mrlx:' key "
        "(or --mrlx-config FILE.yaml on Miles)"
    )


# ---------------------------------------------------------------------------------------------
# Settings that hold text or name a file
# ---------------------------------------------------------------------------------------------

_FILE_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9_-]{0,9}$")


def looks_like_a_path(value: str) -> bool:
    """The rule for settings that hold text or name a file (`system_prompt`, `chat_template`):
    a value that is one line, with no spaces and no braces, and that contains a '/' or ends in a
    file suffix (`.txt`, `.md`, `.jinja`, `.tmpl`, ...), names a file, which must exist. Any
    other value is the text itself: a prompt has spaces, a Jinja template braces."""
    return (
        bool(value)
        and not any(c.isspace() for c in value)
        and "{" not in value
        and "}" not in value
        and ("/" in value or _FILE_SUFFIX.search(value) is not None)
    )


def read_text_setting(value: str | None, base: Path | None = None, key: str = "setting") -> str | None:
    """A setting that holds either text or the path of a text file (system prompts, chat
    templates): the file's text when `value` names an existing file, an error naming `key` when
    it looks like a path (`looks_like_a_path`) but no such file exists, and `value` itself
    otherwise. A relative path is read from `base`, the YAML file's folder (see `config_dir`),
    or the working directory when there is none."""
    if value is None:
        return None
    if "\n" in value or len(value) >= 4096:
        return value
    candidate = Path(value).expanduser()
    if base is not None and not candidate.is_absolute():
        candidate = base / candidate
    # The file as a message may name it (a path from the environment stays `${NAME}`).
    file = show_value(value) if isinstance(value, EnvValue) else str(candidate)
    try:
        is_file = candidate.is_file()
    except OSError:  # e.g. a one-line text longer than a file name may be (ENAMETOOLONG): not a path
        return value
    if is_file:
        try:
            return candidate.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise ConfigError(f"{key}: cannot read {file} ({reason})") from None
    if not looks_like_a_path(value):
        return value
    where = f"from the YAML's folder, {base}" if base is not None else "from the working directory"
    problem = "is a folder, not a file" if candidate.exists() else "does not exist"
    raise ConfigError(
        f"{key}: {show_value(value)} names a file (one line, no spaces or braces, with a '/' or a file "
        f"suffix), but {file} {problem} (a relative path is read {where}); fix the path, or write the "
        "text itself (a prompt with spaces, a template with its braces)"
    )
