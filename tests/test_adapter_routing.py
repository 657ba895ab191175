"""Agents served as LoRA adapters (`mrlx.agents.NAME.adapter`), over real sockets: each agent's
`/generate` requests name its adapter (SGLang's `lora_path`) on the engine it shares with others,
a base agent's name none; an engine that does not serve the adapter ends the episode at once (its
HTTP 400 is not retried); the setting is a name, not a path; and `mrlx check` probes that each
engine serves the adapter its agent names. The engines are stub engines (`--lora-names`), the host
the in-process stand-in (no slime/Miles: nothing refuses a trained adapter here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _host import engine_stats
from test_debate import ENGINE, last_request, run_group

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.core.host import Status
from mrlx_plugin.settings import job_sections

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 2


@pytest.fixture
def lora_stub(logs_dir, request):
    """Start stub engines serving LoRA adapters by name: `lora_stub(*names, text=...)`; all stopped
    at the end."""
    started = []

    def start(*names: str, text: str = "Winner: A"):
        extra = ["--text", text] + (["--lora-names", *names] if names else [])
        started.append(
            start_stub_engine(
                log_dir=logs_dir, name=f"lora-{request.node.name[:30]}-{len(started)}", extra=extra
            )
        )
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


def debate(debaters_url: str, judge_url: str, pro=None, con=None, judge=None, **engine) -> dict:
    """A debate whose debaters share one engine and whose frozen judge has its own; each agent's
    `adapter` as given (None: the engine's base model)."""

    def agent(url: str, adapter: str | None, **more) -> dict:
        return {"url": url, **more, **({"adapter": adapter} if adapter is not None else {})}

    return {
        "run_id": "adapter-routing",
        "system": "debate",
        "agents": {
            "pro": agent("self", pro),
            "con": agent("self", con),
            "judge": agent(judge_url, judge, trainable=False),
        },
        "debate": {"rounds": ROUNDS},
        "engine": {**ENGINE, **engine},
    }


@pytest.mark.parametrize("con", ["con-lora", None], ids=["two-adapters", "adapter-and-base"])
def test_each_agents_turns_go_through_its_own_adapter(con, lora_stub, tiny_model_dir):
    """pro as "pro-lora" and con as "con-lora" (or the base model) on one engine, the frozen judge
    as "judge-lora" on another: each engine counts exactly the turns of each adapter, a base
    agent's requests carry no lora_path at all, and every sample names its agent's adapter."""
    n = 2
    debaters = lora_stub("pro-lora", "con-lora", text="PRO: yes.")
    judge = lora_stub("judge-lora")
    mrlx = debate(debaters.url, judge.url, pro="pro-lora", con=con, judge="judge-lora")
    outs = run_group(debaters.url, tiny_model_dir, mrlx, n)

    debater_stats, judge_stats = engine_stats(debaters.url), engine_stats(judge.url)
    # ROUNDS speeches per debater per episode, one verdict per episode: nothing refused, nothing lost
    assert debater_stats["lora_paths"] == {"pro-lora": n * ROUNDS, (con or ""): n * ROUNDS}, debater_stats
    assert debater_stats["generate"] == 2 * n * ROUNDS, debater_stats
    assert judge_stats["lora_paths"] == {"judge-lora": n} and judge_stats["generate"] == n, judge_stats
    assert last_request(judge.url)["lora_path"] == "judge-lora"
    # con speaks after pro in every round: the debaters' engine's last request is con's
    last = last_request(debaters.url)
    if con is None:
        assert "lora_path" not in last, f"a base agent's request named an adapter: {last.get('lora_path')!r}"
    else:
        assert last["lora_path"] == "con-lora"

    for samples in outs:
        assert [s.metadata["mrlx"]["agent"] for s in samples] == ["pro", "con"]  # the judge is frozen
        assert all(s.status == Status.COMPLETED for s in samples), [s.status for s in samples]
        adapters = {s.metadata["mrlx"]["agent"]: s.metadata["mrlx"]["adapter"] for s in samples}
        assert adapters == {"pro": "pro-lora", "con": con}
        assert samples[0].metadata["mrlx"]["episode"]["winner"] == "pro"  # the judge's verdict was read


@pytest.mark.parametrize(
    "who",
    ["pro", "judge"],
    ids=["own-engine", "peer-engine-retrying-aborts"],
)
def test_an_adapter_the_engine_does_not_serve_aborts_the_episode_without_a_retry(
    who, lora_stub, tiny_model_dir
):
    """An agent whose adapter its engine has not loaded: the engine's 400 ends the episode on that
    one request, ABORTED with the engine's reason. Retries are allowed (engine.max_retries 3) and
    the judge, a peer, retries aborted turns by default: a refusal is still not retried."""
    debaters = lora_stub("pro-lora", text="PRO: yes.")
    judge = lora_stub("judge-lora")
    adapters = {"pro": "pro-lora", "con": None, "judge": "judge-lora", who: "ghost-lora"}
    mrlx = debate(debaters.url, judge.url, **adapters, max_retries=3)
    assert parse_settings(mrlx, source="test", sections=job_sections()).agents["judge"].retry_on_abort is True
    [samples] = run_group(debaters.url, tiny_model_dir, mrlx, n=1)

    assert [s.metadata["mrlx"]["agent"] for s in samples] == ["pro", "con"]  # the fan-out is kept
    for s in samples:
        assert s.status == Status.ABORTED and s.reward == 0.0 and not any(s.loss_mask), s.status
        reason = s.metadata["mrlx"]["abort_reason"]
        assert reason and "'ghost-lora'" in reason and "is not loaded" in reason, reason
        assert "HTTP 400" in reason, reason
    assert samples[0].metadata["mrlx"]["adapter"] == adapters["pro"]

    refused_at = debaters if who == "pro" else judge
    stats = engine_stats(refused_at.url)
    assert last_request(refused_at.url)["lora_path"] == "ghost-lora"
    assert stats["generate"] == 1 and stats["lora_paths"] == {}, stats  # one request, refused, not resent
    if who == "pro":  # pro speaks first: the episode ended there, before any other turn
        assert engine_stats(judge.url)["generate"] == 0
    else:  # every speech was served before the judge's refused verdict
        assert engine_stats(debaters.url)["lora_paths"] == {"pro-lora": ROUNDS, "": ROUNDS}


@pytest.mark.parametrize("bad", ["dir/with/slash", "", "/abs/adapter", "../up", "a" * 129, "two words"])
def test_an_adapter_setting_is_a_name_not_a_path(bad):
    mrlx = debate("http://127.0.0.1:1", "http://127.0.0.1:2", pro="pro-lora", judge=bad)
    with pytest.raises(ConfigError) as err:
        parse_settings(mrlx, source="job.yaml", sections=job_sections())
    message = str(err.value)
    assert message.startswith("job.yaml") and "mrlx.agents.judge.adapter" in message, message
    assert "mrlx.agents.pro" not in message, message  # the good name is not blamed
    ok = parse_settings(
        debate("http://127.0.0.1:1", "http://127.0.0.1:2", judge="a" * 128),
        source="x",
        sections=job_sections(),
    )
    assert ok.agents["judge"].adapter == "a" * 128 and ok.agents["pro"].adapter is None


def mrlx_check(config: Path, router_url: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "mrlx_plugin.cli", "check", "--config", str(config)]
    argv += ["--router-url", router_url, "--skip-tokenizers", "--timeout", "5"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_check_probes_each_agents_adapter_on_its_engine(tmp_path, lora_stub):
    """`mrlx check` sends each agent's engine one generate through the agent's adapter: it passes
    when every engine serves its agents' adapters and, for an adapter an engine does not serve,
    exits 1 with a line naming the agent, the adapter, the engine's 400 and how to fix it."""
    shared = lora_stub("solver-lora", "rewriter-lora")
    frozen = lora_stub("judge-lora")

    def write(name: str, selector: str) -> Path:
        path = tmp_path / name
        path.write_text(
            "mrlx:\n  system: pipeline\n  agents:\n"
            "    solver: {url: self, adapter: solver-lora}\n"
            "    rewriter: {url: self, adapter: rewriter-lora}\n"
            f"    selector: {{url: '{frozen.url}', trainable: false, adapter: {selector}}}\n"
        )
        return path

    r = mrlx_check(write("good.yaml", "judge-lora"), shared.url)
    assert r.returncode == 0, r.stdout + r.stderr
    for name, adapter, url in [
        ("solver", "solver-lora", shared.url),
        ("rewriter", "rewriter-lora", shared.url),
        ("selector", "judge-lora", frozen.url),
    ]:
        assert f"agent '{name}' at {url} serves adapter '{adapter}'" in r.stdout, r.stdout
    assert "all good" in r.stdout, r.stdout
    probes = engine_stats(shared.url)
    assert probes["lora_paths"] == {"solver-lora": 1, "rewriter-lora": 1}, probes

    bad = write("bad.yaml", "missing-lora")
    r = mrlx_check(bad, shared.url)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = [line for line in r.stdout.splitlines() if "missing-lora" in line]
    assert line.startswith("FAIL") and f"{bad}: agent 'selector' at {frozen.url}" in line, line
    assert "does not serve LoRA adapter 'missing-lora': HTTP 400" in line, line
    assert "LoRA adapter 'missing-lora' is not loaded (served: judge-lora)" in line, (
        line
    )  # the engine's words
    assert "--lora-paths missing-lora=DIR" in line and "/load_lora_adapter" in line, line
    assert "correct mrlx.agents.selector.adapter" in line, line
    assert "serves adapter 'solver-lora'" in r.stdout  # the other agents still pass
    assert engine_stats(frozen.url)["generate"] == 2  # one probe per run, the refused one not retried
