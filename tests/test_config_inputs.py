"""Hostile and mistaken settings files: each ends in one message naming the file and the key or
module, never a traceback, a MemoryError or a RecursionError, and never an environment
variable's value. The file checks run `mrlx check --offline` as a user does."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from mrlx_plugin.core.config import ConfigError, looks_like_a_path, parse_settings, settings_from_yaml
from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.local.trainer.settings import SECTIONS as TRAINER_SECTIONS
from mrlx_plugin.runtime import build_runtime
from mrlx_plugin.settings import job_sections

REPO = Path(__file__).resolve().parent.parent
# Every section the package knows: the core's, the built-in systems', the embedded trainer's.
EVERY_SECTION = job_sections(read_here=TRAINER_SECTIONS)
SECRET = "s3cr3t-v4lue"


def check(*argv: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", "check", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {})),
    )


def one_message(r: subprocess.CompletedProcess) -> str:
    """The command failed on the config (exit 2) with one short message and no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    message = r.stderr.strip()
    assert message.startswith("mrlx check: ") and message.count("mrlx check: ") == 1, message[:3000]
    assert len(message) < 1000, message[:3000]
    return message


# --------------------------------------------------------------------------------------------
# YAML bombs, deep nesting, loops
# --------------------------------------------------------------------------------------------

BOMB = (
    "".join(
        f"{c}: &{c} [{', '.join([f'*{p}' if p else 'lol'] * 9)}]\n"
        for p, c in zip(["", *"abcdefgh"], "abcdefghi")
    )
    + "mrlx:\n  plugins: *i\n"
)


def test_a_billion_laughs_yaml_is_one_message_naming_the_file_and_key(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(BOMB)
    msg = one_message(check("--offline", "--config", str(cfg)))
    assert msg.startswith(
        f"mrlx check: {cfg}: line 11: mrlx.plugins: the aliases (*name) of this file repeat "
    )
    assert "billion laughs" in msg and "100,000 allowed" in msg


def test_a_yaml_bomb_under_a_mapping_is_caught_before_it_is_built(tmp_path):
    """The same bomb where settings are walked (a mapping of mappings), read as the host would."""
    cfg = tmp_path / "bomb2.yaml"
    cfg.write_text(
        BOMB.replace("mrlx:\n  plugins: *i\n", "mrlx:\n  rewards:\n    coupling: {a: {b: 1.0}, c: *i}\n")
    )
    with pytest.raises(ConfigError, match=r"line 12: mrlx\.rewards\.coupling\.c: the aliases"):
        settings_from_yaml(cfg, sections=EVERY_SECTION)


def test_deeply_nested_yaml_is_one_message(tmp_path):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("mrlx:\n  plugins: " + "[" * 5000 + "]" * 5000 + "\n")
    msg = one_message(check("--offline", "--config", str(cfg)))
    assert f"{cfg}: line 2: mrlx.plugins[0][0]" in msg and "nested more than 64 levels deep" in msg


def test_nesting_through_aliases_and_alias_loops_are_named(tmp_path):
    chain = tmp_path / "chain.yaml"
    chain.write_text(
        "mrlx:\n  l0: &l0 [x]\n" + "".join(f"  l{i}: &l{i} [*l{i - 1}]\n" for i in range(1, 200))
    )
    with pytest.raises(
        ConfigError, match=r"chain.yaml: line 201: mrlx\.l199\[0\].*nested more than 64 levels deep"
    ):
        settings_from_yaml(chain, sections=EVERY_SECTION)
    loop = tmp_path / "loop.yaml"
    loop.write_text("mrlx:\n  plugins: &a [x, *a]\n")
    with pytest.raises(
        ConfigError,
        match=r"loop.yaml: line 2: mrlx\.plugins\[1\]: an alias refers to a value that "
        r"contains it",
    ):
        settings_from_yaml(loop, sections=EVERY_SECTION)


def test_ordinary_anchors_and_merge_keys_still_work(tmp_path):
    cfg = tmp_path / "anchors.yaml"
    cfg.write_text(
        textwrap.dedent("""\
        defaults: &agent {url: self, sampling: {max_new_tokens: 8, temperature: 0.5}}
        mrlx:
          system: dialogue
          agents:
            doctor: *agent
            patient: {<<: *agent, trainable: false, url: 'http://127.0.0.1:9'}
        """)
    )
    s = settings_from_yaml(cfg, sections=EVERY_SECTION)
    assert s.agents["doctor"].sampling.max_new_tokens == 8 and s.agents["patient"].sampling.temperature == 0.5
    assert s.agents["patient"].trainable is False and s.agents["doctor"].trainable is True
    assert s.agents["patient"].url == "http://127.0.0.1:9" and s.agents["doctor"].url == "self"


# --------------------------------------------------------------------------------------------
# Hook modules that fail to import
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "x = 1\nraise RuntimeError('no GPU here')\n",
            "importing 'broken_hooks' raised RuntimeError at {file}, line 2: no GPU here; fix the module",
        ),
        (
            "def grade(:\n    pass\n",
            "'broken_hooks' has a syntax error ({file}, line 1): invalid syntax; fix the module",
        ),
        (
            "import mrlx_no_such_dependency\n",
            "importing 'broken_hooks' failed at {file}, line 1: it imports 'mrlx_no_such_dependency', which "
            "is not "
            "installed",
        ),
    ],
    ids=["raises", "syntax-error", "missing-dependency"],
)
def test_a_hook_module_that_fails_to_import_is_one_message(tmp_path, source, expected):
    (tmp_path / "broken_hooks.py").write_text(source)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("mrlx:\n  plugins: [broken_hooks]\n")
    msg = one_message(check("--offline", "--config", str(cfg), cwd=tmp_path))
    assert msg.startswith(f"mrlx check: {cfg}: mrlx.plugins[0]: ")
    assert expected.format(file=tmp_path / "broken_hooks.py") in msg


# --------------------------------------------------------------------------------------------
# Settings that name files
# --------------------------------------------------------------------------------------------


def test_the_rule_that_tells_a_path_from_text():
    for path in (
        "templates/chatml.tmpl",
        "chatml.jinja",
        "doctor.txt",
        "/abs/prompt",
        "prompts/doctor",
        "x.j2",
    ):
        assert looks_like_a_path(path), path
    for text in (
        "You answer.",
        "Solve it step by step.",
        "{{ messages }}",
        "{%- for m in messages -%}{{m}}{% endfor %}",
        "Answer",
        "v1.2",
        "3.14",
        "Be brief.\nReally.",
        "{{'</s>'}}",
    ):
        assert not looks_like_a_path(text), text


@pytest.mark.parametrize("key", ["chat_template", "system_prompt"])
def test_a_mistyped_file_is_named_by_check_offline(tmp_path, key):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"mrlx:\n  system: dialogue\n  agents:\n    a: {{url: self, {key}: templates/chatml.tmpl}}\n"
        "    b: {url: self}\n"
    )
    msg = one_message(check("--offline", "--config", str(cfg)))
    assert f"{cfg}: mrlx.agents.a.{key}: 'templates/chatml.tmpl' names a file" in msg
    assert f"{tmp_path / 'templates' / 'chatml.tmpl'} does not exist" in msg


def _runtime_args(tmp_path: Path, body: str, tokenizer: Path) -> argparse.Namespace:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(body))
    return argparse.Namespace(
        custom_config_path=str(cfg),
        hf_checkpoint=str(tokenizer),
        sglang_router_ip="127.0.0.1",
        sglang_router_port=9,
    )


def test_the_rollout_refuses_a_missing_file_and_reads_files_and_inline_text(tmp_path, tiny_tokenizer_dir):
    args = _runtime_args(
        tmp_path,
        """\
        mrlx:
          system: dialogue
          agents:
            a: {url: self, system_prompt: prompts/a.txt}
            b: {url: self}
        """,
        tiny_tokenizer_dir,
    )
    with pytest.raises(
        ConfigError, match=r"job.yaml: mrlx.agents.a.system_prompt: 'prompts/a.txt' names a file"
    ):
        build_runtime(args)

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "a.txt").write_text("You are A.")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    args = _runtime_args(
        tmp_path,
        f"""\
        mrlx:
          system: dialogue
          agents:
            a: {{url: self, system_prompt: prompts/a.txt, chat_template: chat.jinja}}
            b: {{url: self, system_prompt: 'You are B.', chat_template: '{inline}'}}
        """,
        tiny_tokenizer_dir,
    )
    runtime = build_runtime(args)
    assert runtime.context.system_prompts == {"a": "You are A.", "b": "You are B."}
    assert runtime.tokenizers["a"].hf.chat_template == (tmp_path / "chat.jinja").read_text()
    assert runtime.tokenizers["b"].hf.chat_template == inline


# --------------------------------------------------------------------------------------------
# Values from the environment stay out of messages
# --------------------------------------------------------------------------------------------


def test_a_bad_value_from_the_environment_is_named_by_its_variable(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        'mrlx:\n  system: dialogue\n  agents:\n    a: {url: self}\n    b: {url: "${RT_SECRET_TOKEN}"}\n'
    )
    r = check("--offline", "--config", str(cfg), env={"RT_SECRET_TOKEN": SECRET})
    msg = one_message(r)
    assert SECRET not in r.stdout + r.stderr
    assert (
        "mrlx.agents.b.url: got '${RT_SECRET_TOKEN}' (from the environment); expected 'self' or an "
        "http://host:port URL" in msg
    )


def test_no_message_about_settings_shows_an_environment_value(monkeypatch):
    monkeypatch.setenv("RT_SECRET_TOKEN", SECRET)
    with pytest.raises(ConfigError) as info:
        parse_settings(
            {
                "run_id": "run ${RT_SECRET_TOKEN}",
                "system": "dialogue",
                "self": "${RT_SECRET_TOKEN}",
                "agents": {"a": {"url": "ftp://${RT_SECRET_TOKEN}"}, "b": {}},
                "dialogue": {"first": "${RT_SECRET_TOKEN}", "order": ["a", "${RT_SECRET_TOKEN:-x}"]},
            },
            source="job.yaml",
            sections=EVERY_SECTION,
        )
    msg = str(info.value)
    assert "5 problem(s)" in msg and SECRET not in msg
    for key in (
        "mrlx.run_id: got 'run ${RT_SECRET_TOKEN}'",
        "mrlx.self: agent '${RT_SECRET_TOKEN}'",
        "mrlx.agents.a.url: got 'ftp://${RT_SECRET_TOKEN}'",
        "mrlx.dialogue.first: '${RT_SECRET_TOKEN}'",
        "mrlx.dialogue.order[1]: '${RT_SECRET_TOKEN:-x}'",
    ):
        assert key in msg, (key, msg)
    # the values themselves are the environment's
    s = parse_settings(
        {"system": "dialogue", "agents": {"a": {"url": "http://h:1/${RT_SECRET_TOKEN}"}, "b": {}}},
        sections=EVERY_SECTION,
    )
    assert s.agents["a"].url == f"http://h:1/{SECRET}"


def test_check_names_the_variable_of_an_unreachable_url_and_of_two_jobs_that_differ(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/{SECRET}"
    body = (
        'mrlx:\n  run_id: "${{{run}}}"\n  system: dialogue\n  self: {me}\n'
        '  agents: {{a: {{url: self}}, b: {{url: "${{RT_SECRET_URL}}"}}}}\n'
    )
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(body.format(run="RT_RUN_A", me="a"))
    b.write_text(body.format(run="RT_RUN_B", me="b"))
    r = check(
        "--config",
        str(a),
        "--config",
        str(b),
        "--skip-tokenizers",
        "--timeout",
        "2",
        env={"RT_SECRET_URL": dead, "RT_RUN_A": f"run-{SECRET}-a", "RT_RUN_B": f"run-{SECRET}-b"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert SECRET not in r.stdout + r.stderr
    assert "mrlx.run_id '${RT_RUN_B}' differs from" in r.stdout
    assert "agent 'b' at ${RT_SECRET_URL} is unreachable" in r.stdout


# --------------------------------------------------------------------------------------------
# Numbers out of bounds: refused when the file is read, not when the value is used
# --------------------------------------------------------------------------------------------

TWO_AGENTS = "mrlx:\n  system: dialogue\n  agents:\n    a: {url: self}\n    b: {url: self}\n"


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("engine", "request_timeout_s", ".inf", "got inf; expected a finite number"),
        ("engine", "max_connections", "-5", "got -5; expected at least 1"),
        ("engine", "backoff_s", "-1", "got -1; expected 0 or more"),
        ("engine", "peer_deadline_s", "1e12", "got 1000000000000.0; expected at most 86400 (a day"),
        ("agents.a.sampling", "top_k", str(10**30), f"got {10**30}; expected at most 2147483647 ("),
        ("agents.a.sampling", "top_k", "0", "got 0; expected -1 (every token) or at least 1"),
        ("agents.a.sampling", "temperature", ".inf", "got inf; expected a finite number"),
        ("debate", "win_reward", ".nan", "got nan; expected a finite number"),
        ("game", "illegal_penalty", "-.inf", "got -inf; expected a finite number"),
        ("coordinator", "lease_s", "1e12", "got 1000000000000.0; expected at most 604800 (a week"),
        ("rewards", "branch", "1000000", "got 1000000; expected at most 64 ("),
        ("pipeline", "num_parallel", "1000000", "got 1000000; expected at most 256 ("),
        ("trainer", "lr", ".nan", "got nan; expected a finite number"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_a_number_out_of_bounds_is_one_message_from_check_and_at_start_up(
    tmp_path, section, key, value, expected
):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(TWO_AGENTS + ("  rewards: {credit: turn}\n" if key == "branch" else ""))
    data = yaml.safe_load(cfg.read_text())
    holder = data["mrlx"]
    for part in section.split("."):
        holder = holder.setdefault(part, {})
    holder[key] = yaml.safe_load(value)
    cfg.write_text(yaml.safe_dump(data))
    where = f"mrlx.{section}.{key}"
    msg = one_message(check("--offline", "--config", str(cfg), "--skip-tokenizers"))
    assert msg.startswith(f"mrlx check: {cfg}: 1 problem(s):"), msg
    assert f"{where}: {expected}" in msg, msg
    args = argparse.Namespace(
        custom_config_path=str(cfg),
        hf_checkpoint=None,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=9,
        mrlx_sections=TRAINER_SECTIONS,  # as the embedded trainer's host args name its section
    )
    with pytest.raises(ConfigError) as info:  # the rollout's own start-up reads the file the same way
        build_runtime(args, tokenizers=False)
    assert f"{where}: {expected}" in str(info.value) and "1 problem(s)" in str(info.value)


@pytest.mark.parametrize(
    "flag, value, shown",
    [
        ("--wait", "nan", "nan"),
        ("--wait", "inf", "inf"),
        ("--timeout", "-1", "-1"),
        ("--timeout", "1e9", "1e+09"),
    ],
)
def test_check_refuses_seconds_out_of_bounds_on_its_command_line(tmp_path, flag, value, shown):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(TWO_AGENTS)
    r = check("--config", str(cfg), flag, value)
    assert r.returncode == 2 and f"mrlx check: error: {flag} {shown}: expected seconds" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "options, expected",
    [
        ("{max_stones: .inf}", "mrlx.game.options.max_stones: got inf"),
        ("{heaps: [.inf, 3]}", "'heaps' is no option of nim"),
    ],
)
def test_a_built_in_games_options_are_checked_by_check_as_at_start_up(tmp_path, options, expected):
    # game.options is free-form for plugin games; a built-in game checks its own, offline too.
    cfg = tmp_path / "nim.yaml"
    cfg.write_text(
        f"mrlx:\n  system: game\n  agents: {{a: {{}}, b: {{}}}}\n  game: {{name: nim, options: {options}}}\n"
    )
    r = check("--offline", "--config", str(cfg), "--skip-tokenizers")
    assert r.returncode != 0 and expected in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
    args = argparse.Namespace(
        custom_config_path=str(cfg), hf_checkpoint=None, sglang_router_ip="127.0.0.1", sglang_router_port=9
    )
    with pytest.raises(ConfigError, match=expected.replace("[", "\\[")):
        build_runtime(args, tokenizers=False)
