"""Settings: every bad input gets one message naming the key and what is expected."""

from __future__ import annotations

import argparse
import math
import textwrap

import pytest

from mrlx_plugin.core.config import ConfigError, parse_settings, settings_from_yaml
from mrlx_plugin.local.trainer.settings import SECTIONS as TRAINER_SECTIONS
from mrlx_plugin.runtime import build_runtime
from mrlx_plugin.settings import job_sections

# Every section the package knows: the core's, the built-in systems', the embedded trainer's.
EVERY_SECTION = job_sections(read_here=TRAINER_SECTIONS)


def errors_of(data, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        parse_settings(data, source="job.yaml", sections=EVERY_SECTION, **kw)
    return str(info.value)


def test_defaults_give_the_pipeline_with_three_roles_on_self():
    s = parse_settings({}, sections=EVERY_SECTION)
    assert s.system == "pipeline"
    assert list(s.agents) == ["solver", "rewriter", "selector"]
    assert all(a.url == "self" and a.trainable for a in s.agents.values())
    assert (
        s.pipeline.num_parallel == 5
        and s.pipeline.correct_weight == 1.2
        and s.pipeline.incorrect_weight == 0.8
    )


def test_unknown_key_is_named_with_a_suggestion():
    msg = errors_of({"pipeline": {"num_paralel": 3}})
    assert "job.yaml" in msg
    assert "mrlx.pipeline.num_paralel: unknown key; did you mean 'num_parallel'?" in msg


def test_unknown_top_level_key_is_named():
    msg = errors_of({"agnets": {}})
    assert "mrlx.agnets: unknown key; did you mean 'agents'?" in msg


def test_wrong_types_name_the_key_and_the_expected_type():
    msg = errors_of(
        {
            "pipeline": {"num_parallel": "five", "correct_weight": True},
            "agents": {"solver": {"url": "self", "sampling": {"temperature": "hot"}}},
        }
    )
    assert "mrlx.pipeline.num_parallel: got str 'five'; expected an integer" in msg
    assert "mrlx.pipeline.correct_weight: got bool True; expected a number" in msg
    assert "expected at least 1" not in msg  # a bad value is reported once, not again as its fallback
    assert "mrlx.agents.solver.sampling.temperature: got str 'hot'; expected a number" in msg


def test_every_problem_is_reported_at_once():
    msg = errors_of({"run_id": "bad id!", "engine": {"max_retries": -1}, "pipeline": {"num_parallel": 0}})
    assert "3 problem(s)" in msg
    assert "mrlx.run_id" in msg and "mrlx.engine.max_retries" in msg and "mrlx.pipeline.num_parallel" in msg


def test_missing_pipeline_agent_is_named():
    msg = errors_of({"agents": {"solver": {"url": "self"}, "rewriter": {"url": "self"}}})
    assert "mrlx.agents: the pipeline system needs agents solver, rewriter, selector; missing selector" in msg


def test_bad_url_and_unknown_self_agent():
    msg = errors_of(
        {
            "system": "dialogue",
            "self": "nurse",
            "agents": {"doctor": {"url": "self"}, "patient": {"url": "10.0.0.2:3333"}},
        }
    )
    assert "mrlx.agents.patient.url: got '10.0.0.2:3333'; expected 'self' or an http://host:port URL" in msg
    assert "mrlx.self: agent 'nurse' is not under mrlx.agents" in msg


def test_negative_staleness_is_rejected():
    msg = errors_of({"coordinator": {"max_staleness": -1}})
    assert "mrlx.coordinator.max_staleness: got -1; expected 0 or more" in msg


def test_dialogue_references_must_be_agents():
    msg = errors_of(
        {
            "system": "dialogue",
            "agents": {"a": {}, "b": {}},
            "dialogue": {"first": "c", "order": ["a", "z"], "stop_patterns": {"q": "DONE"}},
        }
    )
    assert "mrlx.dialogue.first: 'c' is not an agent" in msg
    assert "mrlx.dialogue.order[1]: 'z' is not an agent" in msg
    assert "mrlx.dialogue.stop_patterns.q: not an agent" in msg


def test_unregistered_system_is_named():
    msg = errors_of({"system": "auction"}, known_systems={"pipeline", "dialogue"})
    assert "mrlx.system: no agent system named 'auction' is registered" in msg


def test_yaml_without_top_key(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("pipeline: {num_parallel: 2}\n")
    with pytest.raises(ConfigError, match="no top-level 'mrlx' key"):
        settings_from_yaml(path, sections=EVERY_SECTION)


def test_broken_yaml_names_the_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("mrlx: {pipeline: [\n")
    with pytest.raises(ConfigError, match=str(path)):
        settings_from_yaml(path, sections=EVERY_SECTION)


def _args(tmp_path, body: str, **extra) -> argparse.Namespace:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(body))
    ns = argparse.Namespace(custom_config_path=str(path), hf_checkpoint=None, **extra)
    return ns


def test_self_url_without_a_router_is_named(tmp_path, tiny_tokenizer_dir):
    args = _args(tmp_path, "mrlx: {system: pipeline}\n", sglang_router_ip=None, sglang_router_port=None)
    args.hf_checkpoint = str(tiny_tokenizer_dir)
    with pytest.raises(ConfigError, match=r"mrlx.agents.solver.url: 'self' means this job's router"):
        build_runtime(args)


def test_missing_tokenizer_is_named(tmp_path):
    args = _args(
        tmp_path,
        "mrlx: {agents: {solver: {url: 'http://127.0.0.1:1'}, rewriter: {url: 'http://127.0.0.1:1'}, "
        "selector: {url: 'http://127.0.0.1:1'}}}\n",
    )
    with pytest.raises(
        ConfigError, match=r"mrlx.agents.solver.tokenizer: not set and the host gave no --hf-checkpoint"
    ):
        build_runtime(args)


def test_plugin_that_cannot_import_is_named(tmp_path):
    args = _args(tmp_path, "mrlx: {plugins: [no_such_module_xyz]}\n")
    with pytest.raises(ConfigError, match=r"mrlx.plugins\[0\]: cannot import 'no_such_module_xyz'"):
        build_runtime(args)


def test_misspelled_hook_in_a_user_module_is_named(tmp_path, monkeypatch):
    (tmp_path / "typo_hooks.py").write_text(
        "from mrlx_plugin import hookimpl\n\n@hookimpl\ndef mrlx_grades(agent, transcript, episode):\n    "
        "return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _args(tmp_path, "mrlx: {plugins: [typo_hooks]}\n")
    with pytest.raises(ConfigError, match="mrlx_grades"):
        build_runtime(args)


def test_apply_chat_template_is_refused_with_the_fix(tmp_path, tiny_tokenizer_dir):
    args = _args(
        tmp_path, "mrlx: {}\n", sglang_router_ip="127.0.0.1", sglang_router_port=1, apply_chat_template=True
    )
    args.hf_checkpoint = str(tiny_tokenizer_dir)
    with pytest.raises(ConfigError, match="remove that flag"):
        build_runtime(args)


def test_base64_config_as_miles_passes_it(tmp_path):
    import base64

    from mrlx_plugin.core.config import raw_settings_from_args

    payload = base64.b64encode(b"mrlx: {run_id: inline-run}\n").decode()
    raw, source, base = raw_settings_from_args(argparse.Namespace(custom_config_path="base64:" + payload))
    assert raw == {"run_id": "inline-run"}
    assert base is None and "base64:" in source and payload not in source


def test_inline_config_longer_than_a_file_name_builds_a_runtime(tiny_tokenizer_dir):
    """Miles sets the inline YAML's keys on args and keeps `base64:...` in custom_config_path; a
    payload longer than a file name once crashed the runtime (it was probed as a path)."""
    import base64

    import yaml

    text = "mrlx:\n  system: dialogue\n  agents:\n" + "".join(
        f"    agent_{i}: {{url: self, system_prompt: 'You are agent number {i} of a long team.'}}\n"
        for i in range(8)
    )
    assert len(text) > 400
    args = argparse.Namespace(
        custom_config_path="base64:" + base64.b64encode(text.encode()).decode(),
        mrlx=yaml.safe_load(text)["mrlx"],
        hf_checkpoint=str(tiny_tokenizer_dir),
        sglang_router_ip="127.0.0.1",
        sglang_router_port=9,
    )
    runtime = build_runtime(args)
    assert runtime.context.system_prompts["agent_3"] == "You are agent number 3 of a long team."
    assert runtime.source == "--custom-config-path base64:..."


def test_broken_inline_config_is_one_message():
    from mrlx_plugin.core.config import raw_settings_from_args

    with pytest.raises(ConfigError, match=r"base64:\.\.\.: the payload is not base64"):
        raw_settings_from_args(argparse.Namespace(custom_config_path="base64:not base64 at all!"))


def test_two_agents_with_one_name_are_refused_not_merged(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(
        "mrlx:\n  system: dialogue\n  agents:\n    doctor: {url: self}\n    patient: {url: self}\n"
        "    doctor: {url: 'http://127.0.0.1:9'}\n"
    )
    with pytest.raises(ConfigError, match=r"key 'doctor' appears twice in one mapping \(lines 4 and 6\)"):
        settings_from_yaml(path, sections=EVERY_SECTION)
    # also when the host (slime) has parsed the file already and handed over args.mrlx
    import yaml

    args = argparse.Namespace(
        custom_config_path=str(path), mrlx=yaml.safe_load(path.read_text())["mrlx"], hf_checkpoint=None
    )
    with pytest.raises(ConfigError, match="appears twice"):
        build_runtime(args)


# --------------------------------------------------------------------------------------------
# The schema as pydantic models: its reference, and the messages built from pydantic's errors
# --------------------------------------------------------------------------------------------


def _sections():
    """Every settings model, reached from Settings through its fields."""
    import typing

    from pydantic import BaseModel

    from mrlx_plugin.core.config import settings_model

    Settings = settings_model(EVERY_SECTION)
    seen, todo = [], [Settings]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for f in model.model_fields.values():
            for tp in (f.annotation, *typing.get_args(f.annotation)):
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    todo.append(tp)
    return seen


def test_every_setting_has_a_description():
    sections = _sections()
    assert {m.__name__ for m in sections} >= {
        "Settings",
        "AgentSettings",
        "SamplingSettings",
        "EngineSettings",
        "PipelineSettings",
        "RewardSettings",
        "DialogueSettings",
        "CoordinatorSettings",
        "TrainerSettings",
    }
    missing = [
        f"{m.__name__}.{name}"
        for m in sections
        for name, f in m.model_fields.items()
        if not (f.description or "").strip()
    ]
    assert not missing, f"settings without a description: {missing}"


def test_the_reference_table_lists_every_key_with_type_default_and_description():
    from mrlx_plugin.core.config import settings_model, settings_reference_markdown

    table = settings_reference_markdown(settings_model(EVERY_SECTION))
    lines = table.splitlines()
    assert lines[0] == "| key | type | default | meaning |"
    rows = {line.split(" | ")[0].strip("| `"): line for line in lines[2:]}
    fields = sum(len(m.model_fields) for m in _sections())
    assert len(rows) == fields, sorted(rows)
    assert (
        "| `mrlx.agents.NAME.sampling.top_p` | a number (more than 0, at most 1) or null | `null` | "
        "nucleus sampling mass"
    ) in table
    assert "| `mrlx.engine.max_retries` | an integer (0 to 100) | `3` |" in table
    # an upper bound says what it protects
    assert "| `mrlx.rewards.branch` | an integer (1 to 64) | `1` |" in table
    assert rows["mrlx.rewards.branch"].endswith(
        "(the limit: each candidate is one more model call per trainable turn) |"
    )
    assert "mrlx.self" in rows and "`mrlx.extra`" not in table and "mrlx.<system name>" in rows
    assert "'offset' \\| 'multiplicative' \\| 'none'" in rows["mrlx.pipeline.weighting"]  # no stray column
    assert all(line.replace("\\|", "").count("|") == 5 for line in lines), table  # four columns on every line


def test_the_json_schema_names_the_yaml_keys():
    from mrlx_plugin.core.config import settings_model

    schema = settings_model(EVERY_SECTION).model_json_schema()
    assert "self" in schema["properties"] and "extra" not in schema["properties"]
    assert schema["additionalProperties"]["type"] == "object"  # the sections of plugin systems
    engine = schema["$defs"]["EngineSettings"]["properties"]
    assert engine["request_timeout_s"]["exclusiveMinimum"] == 0 and engine["max_retries"]["minimum"] == 0
    top_p = schema["$defs"]["SamplingSettings"]["properties"]["top_p"]["anyOf"][0]
    assert top_p == {"exclusiveMinimum": 0, "maximum": 1, "type": "number"}


def test_a_bad_value_and_a_problem_between_sections_are_reported_together():
    msg = errors_of(
        {
            "system": "dialogue",
            "self": "nurse",
            "agents": {"a": {"trainable": "yes"}, "b": {}},
            "engine": {"request_timeout_s": 0},
            "rewards": {"shaping": "selfish"},
        }
    )
    assert "4 problem(s)" in msg
    assert "mrlx.agents.a.trainable: got 'yes'; expected true or false" in msg
    assert "mrlx.engine.request_timeout_s: got 0; expected a positive number of seconds" in msg
    assert "mrlx.rewards.shaping: got 'selfish'; expected 'independent' | 'cooperative'" in msg
    assert "mrlx.self: agent 'nurse' is not under mrlx.agents (agents: a, b)" in msg


def test_a_bad_value_shared_by_a_yaml_alias_is_named_at_each_place(tmp_path):
    path = tmp_path / "alias.yaml"
    path.write_text(
        "base: &agent {url: 'ftp://host', sampling: {top_p: 2}}\n"
        "mrlx: {system: dialogue, agents: {doctor: *agent, patient: *agent}}\n"
    )
    with pytest.raises(ConfigError) as info:
        settings_from_yaml(path, sections=EVERY_SECTION)
    msg = str(info.value)
    assert msg.startswith(f"{path}: 4 problem(s):"), msg
    for who in ("doctor", "patient"):
        assert f"mrlx.agents.{who}.url: got 'ftp://host'; expected 'self' or an http://host:port URL" in msg
        assert f"mrlx.agents.{who}.sampling.top_p: got 2; expected at most 1" in msg


def test_numbers_as_yaml_writes_them_and_strict_types(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text(
        "mrlx: {trainer: {lr: 3e-4, threads: 2}, engine: {backoff_s: 1}}\n"
    )  # YAML 1.1: 3e-4 is a string
    s = settings_from_yaml(path, sections=EVERY_SECTION)
    assert s.trainer.lr == 3e-4 and s.engine.backoff_s == 1.0 and isinstance(s.engine.backoff_s, float)
    msg = errors_of({"trainer": {"threads": 1.5, "lr": "fast"}, "plugins": ["a", 3]})
    assert "mrlx.trainer.threads: got float 1.5; expected an integer" in msg
    assert "mrlx.trainer.lr: got str 'fast'; expected a number" in msg
    assert "mrlx.plugins[1]: got int 3; expected a string" in msg


def test_keys_that_are_not_strings_are_one_message():
    msg = errors_of({1: {}, "agents": {2: {}}})
    assert "mrlx: key 1 must be a string" in msg and "mrlx.agents: key 2 must be a string" in msg


def test_sections_built_in_python_fill_in_what_follows_from_the_url():
    from mrlx_plugin.core.config import AgentSettings, EngineSettings

    peer = AgentSettings(url="http://127.0.0.1:9")
    assert peer.trainable is False and peer.retry_on_abort is True
    assert AgentSettings().trainable is True and AgentSettings().retry_on_abort is False
    assert EngineSettings(max_retries=1, backoff_s=0.01).request_timeout_s == 900.0


def _numeric_keys():
    """(dotted path under mrlx, the YAML to put a number there, int or float) of every numeric
    setting, walked from the models: a new setting is covered without a line here."""
    import typing

    from pydantic import BaseModel

    from mrlx_plugin.core.config import settings_model
    from mrlx_plugin.core.config import unwrap as _unwrap

    out, todo = [], [(settings_model(EVERY_SECTION), [])]
    while todo:
        model, path = todo.pop()
        for name, f in model.model_fields.items():
            key, tp = f.alias or name, _unwrap(f.annotation)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                todo.append((tp, path + [key]))
            elif (
                typing.get_origin(tp) is dict
                and isinstance(_unwrap(typing.get_args(tp)[1]), type)
                and issubclass(_unwrap(typing.get_args(tp)[1]), BaseModel)
            ):
                todo.append((_unwrap(typing.get_args(tp)[1]), path + [key, "a"]))
            elif typing.get_origin(tp) is dict and typing.get_origin(_unwrap(typing.get_args(tp)[1])) is dict:
                out.append((path + [key, "a", "b"], float))  # rewards.coupling: agent -> agent -> weight
            elif typing.get_origin(tp) is list and _unwrap(typing.get_args(tp)[0]) in (int, float):
                out.append((path + [key], list))
            elif tp in (int, float):
                out.append((path + [key], tp))
    return out


def _with(path: list[str], value) -> dict:
    data = {"system": "dialogue", "agents": {"a": {}, "b": {}}}
    holder = data
    for part in path[:-1]:
        holder = holder.setdefault(part, {})
    holder[path[-1]] = value
    return data


# outcomes and weights of either sign
SIGNED = {"game.illegal_penalty", "debate.win_reward", "debate.lose_reward", "rewards.coupling.a.b"}


def test_every_numeric_setting_is_finite_and_bounded_below_naming_its_key():
    keys = _numeric_keys()
    assert len(keys) > 40, keys  # the walk found the settings
    for path, kind in keys:
        dotted = "mrlx." + ".".join(path)
        if kind is float:
            for bad in (math.inf, -math.inf, math.nan):
                msg = errors_of(_with(path, bad))
                assert f"{dotted}: got {bad}; expected a finite number" in msg and "1 problem(s)" in msg, msg
        if ".".join(path) not in SIGNED:
            bad = [-(10**30)] if kind is list else -(10**30)
            msg = errors_of(_with(path, bad))
            assert "1 problem(s)" in msg and f"{dotted}" in msg and "expected" in msg, msg


def test_a_one_line_text_longer_than_a_file_name_is_text():
    # 300 characters on one line: no file system takes it as a name (ENAMETOOLONG), so it is text.
    from mrlx_plugin.core.config import read_text_setting

    prompt = "You are a careful solver. " * 12
    assert read_text_setting(prompt, key="mrlx.agents.solver.system_prompt") == prompt
