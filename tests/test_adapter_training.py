"""One agent as a LoRA adapter on a shared base model: the adapter is built to start as the base
exactly; the embedded trainer's pieces train only the adapter and save only the adapter, leaving
the base and any other agent's adapter as they were; the trainer insists that --adapter and the
agent's `adapter` setting come together; and a push loads the adapter by name (SGLang's
/load_lora_adapter) and reports an engine's refusal."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import yaml  # noqa: E402
from aiohttp import web  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_local_engine import race  # noqa: E402

from mrlx_plugin.core.config import ConfigError, parse_settings  # noqa: E402
from mrlx_plugin.local.model import (  # noqa: E402
    LORA_TARGET_MODULES,
    ensure_adapter,
    ensure_model,
    is_adapter_dir,
    load_model,
    load_policy,
    load_tokenizer,
)
from mrlx_plugin.local.trainer.loss import ppo_step, token_logprobs, trainable_parameters  # noqa: E402
from mrlx_plugin.local.trainer.settings import TrainerSettings  # noqa: E402
from mrlx_plugin.local.trainer.warm_start import warm_start  # noqa: E402
from mrlx_plugin.local.trainer.weights import (  # noqa: E402
    engine_version,
    push_weights,
    save_checkpoint,
    trained_adapter,
)
from mrlx_plugin.settings import job_sections  # noqa: E402

IDS = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ensure_model(tmp_path_factory.mktemp("adapters") / "base", preset="tiny", seed=5)


@pytest.fixture(scope="module")
def other_adapter(base, tmp_path_factory) -> Path:
    """Another agent's adapter that already differs from the base (its B matrices are not 0)."""
    fresh = ensure_adapter(tmp_path_factory.mktemp("other") / "fresh", base, rank=4, alpha=8, seed=2)
    model = load_policy(base, fresh, trainable=True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    out = fresh.parent / "trained"
    model.save_pretrained(str(out))
    return out


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_ensure_adapter_builds_a_peft_adapter_that_starts_as_the_base(base, tmp_path):
    target = tmp_path / "a"
    results = race(lambda: ensure_adapter(target, base, rank=4, alpha=8, seed=1))
    assert results == [target, target]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary directories left
    # peft's "default" adapter: the files sit at the top of the directory, not in a subfolder.
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in target.iterdir()}
    assert is_adapter_dir(target) and not is_adapter_dir(base)
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert set(config["target_modules"]) == set(LORA_TARGET_MODULES)

    tensors = load_file(str(target / "adapter_model.safetensors"))
    assert tensors and all("lora_A" in k or "lora_B" in k for k in tensors)
    assert not any("lm_head" in k or "embed" in k for k in tensors)
    # Every linear layer of both blocks: 7 modules x 2 layers x (A, B).
    assert len(tensors) == len(LORA_TARGET_MODULES) * 2 * 2
    assert all(not t.any() for k, t in tensors.items() if "lora_B" in k)  # B = 0
    assert all(t.any() for k, t in tensors.items() if "lora_A" in k)
    assert torch.equal(logits(load_policy(base, target)), logits(load_model(base)))

    # The same settings elsewhere give the same adapter; a rerun is a no-op; other settings refuse.
    again = load_file(
        str(ensure_adapter(tmp_path / "a2", base, rank=4, alpha=8, seed=1) / "adapter_model.safetensors")
    )
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    mtime = (target / "adapter_model.safetensors").stat().st_mtime_ns
    assert ensure_adapter(target, base, rank=4, alpha=8, seed=1) == target
    assert (target / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="rank"):
        ensure_adapter(target, base, rank=8, alpha=8, seed=1)
    with pytest.raises(ValueError, match="seed"):
        ensure_adapter(target, base, rank=4, alpha=8, seed=2)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_policy(base, tmp_path / "missing")


def _samples(n: int) -> list[SimpleNamespace]:
    rng = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(3, 500, (10,), generator=rng).tolist()
        out.append(
            SimpleNamespace(
                tokens=tokens, response_length=4, loss_mask=[1, 1, 1, 1], rollout_log_probs=[-6.0] * 4
            )
        )
    return out


def test_training_an_adapter_changes_only_that_adapter_and_saves_only_it(base, other_adapter, tmp_path):
    tok = load_tokenizer(base)
    base_state = {k: v.clone() for k, v in load_model(base).state_dict().items()}
    other_before = logits(load_policy(base, other_adapter))
    start = ensure_adapter(tmp_path / "a", base, rank=4, alpha=8, seed=1)

    policy = load_policy(base, start, trainable=True)
    params = trainable_parameters(policy)
    named = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert named and all("lora_" in n for n in named)
    assert sum(p.numel() for p in params) < sum(p.numel() for p in policy.parameters()) / 2

    rows = tmp_path / "warm.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"{i}+1"},
                        {"role": "assistant", "content": str(i + 1)},
                    ]
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    losses = warm_start(policy, tok, str(rows), steps=3, lr=1e-2, batch=2, seed=0)
    assert len(losses) == 3 and losses[-1] < losses[0]

    # An RL step as the trainer takes it, with a KL to the frozen starting adapter.
    cfg = TrainerSettings(kl_coef=0.1, micro_batch_size=2, lr=1e-2)
    ref = load_policy(base, start)
    assert not any(p.requires_grad for p in ref.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    stats = ppo_step(policy, ref, optimizer, _samples(4), [1.0, -1.0, 0.5, -0.5], cfg, temperature=1.0)
    assert stats["train/tokens"] == 16.0 and stats["train/grad_norm"] > 0

    # The base weights inside the policy are the base model's; the adapter's B is no longer 0.
    for name, value in policy.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base_state[name.replace(".base_layer", "")]), name
    assert any(p.any() for n, p in policy.named_parameters() if "lora_B" in n)
    trained = logits(policy)
    assert not torch.allclose(trained, logits(load_model(base)))

    checkpoint = save_checkpoint(tmp_path / "out", 0, policy, tok, optimizer, None, keep=2)
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "tokenizer.json"} <= files
    assert not files & {"model.safetensors", "config.json"}, files  # the base is not copied
    assert all("lora_" in k for k in load_file(str(checkpoint / "adapter_model.safetensors")))
    assert torch.allclose(logits(load_policy(base, checkpoint)), trained, atol=1e-6)

    # On disk nothing of the base or of the other agent's adapter moved; served side by side on
    # one base (as an engine serves both), each adapter computes what it computed alone.
    assert all(torch.equal(v, base_state[k]) for k, v in load_model(base).state_dict().items())
    assert torch.equal(logits(load_policy(base, other_adapter)), other_before)
    both = peft.PeftModel.from_pretrained(load_model(base), str(checkpoint), adapter_name="a")
    both.load_adapter(str(other_adapter), adapter_name="b")
    both.eval()
    both.set_adapter("b")
    assert torch.allclose(logits(both), other_before, atol=1e-6)
    both.set_adapter("a")
    assert torch.allclose(logits(both), trained, atol=1e-6)


def test_the_trainer_takes_log_probs_of_the_adapter_it_trains(base, other_adapter):
    # token_logprobs runs the peft model as it runs a whole model: through the adapter.
    ids, attention = IDS, torch.ones_like(IDS)
    with torch.no_grad():
        via_adapter = token_logprobs(load_policy(base, other_adapter), ids, attention, 1.0)
        via_base = token_logprobs(load_model(base), ids, attention, 1.0)
    assert via_adapter.shape == via_base.shape and not torch.allclose(via_adapter, via_base)


# --- --adapter and the agent's `adapter` setting -----------------------------------------------


def _settings(self_agent: str | None, adapter: str | None) -> Any:
    doctor: dict[str, Any] = {"url": "self"} if adapter is None else {"url": "self", "adapter": adapter}
    data: dict[str, Any] = {"system": "dialogue", "agents": {"doctor": doctor, "patient": {"url": "self"}}}
    if self_agent is not None:
        data["self"] = self_agent
    return parse_settings(data, sections=job_sections())


def test_a_whole_model_needs_no_adapter_and_refuses_one():
    assert trained_adapter(_settings("doctor", None), None) is None
    assert trained_adapter(_settings(None, None), None) is None
    with pytest.raises(ConfigError, match="mrlx.agents.doctor.adapter"):
        trained_adapter(_settings("doctor", None), "runs/doctor-lora")
    with pytest.raises(ConfigError, match="mrlx.self"):
        trained_adapter(_settings(None, None), "runs/doctor-lora")


def test_an_agent_served_as_an_adapter_needs_its_initial_adapter():
    assert trained_adapter(_settings("doctor", "doctor-lora"), "runs/doctor-lora") == "doctor-lora"
    with pytest.raises(ConfigError, match="--adapter DIR"):
        trained_adapter(_settings("doctor", "doctor-lora"), None)
    # Another agent's adapter is not the trained agent's.
    assert trained_adapter(_settings("patient", "doctor-lora"), None) is None
    # A job that trains the engine's whole model cannot train an agent served as an adapter on it.
    with pytest.raises(ConfigError, match="mrlx.agents.doctor.adapter: this job trains the engine's whole"):
        trained_adapter(_settings(None, "doctor-lora"), None)


def test_the_trainer_refuses_an_adapter_the_trained_agent_is_not_served_with(base, tmp_path):
    config = tmp_path / "job.yaml"
    agents = {
        "doctor": {"url": "self", "tokenizer": str(base)},
        "patient": {"url": "http://127.0.0.1:9", "tokenizer": str(base)},
    }
    config.write_text(yaml.safe_dump({"mrlx": {"self": "doctor", "system": "dialogue", "agents": agents}}))
    adapter = ensure_adapter(tmp_path / "a", base, rank=4, alpha=8, seed=1)
    argv = [
        *("--config", str(config), "--model", str(base), "--adapter", str(adapter)),
        *(
            "--engine-url",
            "http://127.0.0.1:9",
            "--router-url",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "out"),
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.local.trainer", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "trainer: --adapter" in proc.stderr and "mrlx.agents.doctor.adapter" in proc.stderr


# --- pushes: /load_lora_adapter -----------------------------------------------------------------


class _AdapterEngine:
    """An HTTP server on a real socket that answers /load_lora_adapter as SGLang does, refusing
    when told to, and lists what it loaded in /server_info."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.refuse: str | None = None
        self.loaded: dict[str, dict[str, str]] = {}
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.refuse:
            return web.json_response({"success": False, "error_message": self.refuse}, status=400)
        self.loaded[body["lora_name"]] = {
            "lora_path": body["lora_path"],
            "weight_version": body["weight_version"],
        }
        return web.json_response(
            {
                "success": True,
                "error_message": "",
                "loaded_adapters": {n: a["lora_path"] for n, a in self.loaded.items()},
            }
        )

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "base-7", "lora_adapters": self.loaded})

    async def _main(self) -> None:
        app = web.Application()
        app.router.add_post("/load_lora_adapter", self._load)
        app.router.add_get("/server_info", self._info)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.run_forever()

    def __enter__(self) -> _AdapterEngine:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_an_adapter_push_loads_it_by_name_and_reports_a_refusal(tmp_path):
    with _AdapterEngine() as eng:
        assert engine_version(eng.url, "doctor-lora") is None  # not loaded yet
        push_weights([eng.url], tmp_path / "step_00003", version=4, adapter="doctor-lora")
        assert eng.bodies == [
            {
                "lora_name": "doctor-lora",
                "lora_path": str(tmp_path / "step_00003"),
                "upsert": True,
                "weight_version": "4",
            }
        ]
        assert engine_version(eng.url, "doctor-lora") == "4"
        assert engine_version(eng.url, "patient-lora") is None

        eng.refuse = "LoRA rank 64 exceeds --max-lora-rank 16"
        with pytest.raises(RuntimeError) as refused:
            push_weights([eng.url], tmp_path / "step_00004", version=5, adapter="doctor-lora", deadline_s=5)
        message = str(refused.value)
        assert eng.url in message and "'doctor-lora'" in message and "HTTP 400" in message
        assert "exceeds --max-lora-rank 16" in message
        assert engine_version(eng.url, "doctor-lora") == "4"  # the refused push changed nothing
        url = eng.url
    assert engine_version(url, "doctor-lora") is None  # unreachable


# --- the host refusal, and who is exempt -------------------------------------------------------


@pytest.mark.parametrize("host", ["slime", "miles"])
def test_a_host_that_cannot_train_adapters_refuses_the_trained_one_only(host, monkeypatch):
    from mrlx_plugin.core import host as host_module
    from mrlx_plugin.hostcheck import check_trained_adapters

    monkeypatch.setattr(host_module, "HOST", host)
    job = _settings("doctor", "doctor-lora")
    with pytest.raises(ConfigError) as refused:
        check_trained_adapters(SimpleNamespace(), job, ["doctor"], "job.yaml")
    message = str(refused.value)
    assert message.startswith("job.yaml: mrlx.agents.doctor.adapter: this ")
    assert ("slime has no LoRA training path" if host == "slime" else "Miles trains LoRA adapters") in message
    # the job's own agent: freezing it means no job of its own
    assert "no job with mrlx.self: doctor" in message
    # an agent another job trains, or none: nothing to refuse here
    check_trained_adapters(SimpleNamespace(), job, ["patient"], "job.yaml")
    # the embedded trainer trains adapters even where slime or Miles can be imported
    check_trained_adapters(SimpleNamespace(mrlx_trains_adapters=True), job, ["doctor"], "job.yaml")
    monkeypatch.setattr(host_module, "HOST", None)
    check_trained_adapters(SimpleNamespace(), job, ["doctor"], "job.yaml")


def test_the_demo_resumes_a_run_only_as_it_was_started(base, tmp_path):
    from mrlx_lab.demos.co_training import build_parser, run_demo

    checkpoint = tmp_path / "run" / "proposer" / "checkpoints" / "step_00002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a LoRA adapter; resume the run with --adapters"):
        run_demo(build_parser().parse_args(["--out", str(tmp_path / "run"), "--resume", "--quiet"]))
