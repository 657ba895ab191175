"""The trainer's checkpoints and weight pushes: saving a step (weights, tokenizer, trainer state),
finding the latest, loading it into every engine of the agent (SGLang's
/update_weights_from_disk, or /load_lora_adapter for an adapter) and reading the version back;
which adapter, if any, the job trains; and the snapshots of a game's population of past
policies (`Snapshots`)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from mrlx_plugin.core.config import Settings
    from mrlx_plugin.local.model import Policy
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource
    from mrlx_plugin.systems.game_pool import PopulationSettings

log = logging.getLogger("mrlx.trainer")


def save_checkpoint(
    out: Path,
    step: int,
    model: Policy,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    data_source: LocalDataSource,
    keep: int,
) -> Path:
    """out/checkpoints/step_{step:05d}: the weights (from_pretrained layout; of a LoRA policy, only
    the adapter, in peft's layout), the tokenizer and the trainer state."""
    import torch

    final = out / "checkpoints" / f"step_{step:05d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "data_source": data_source.state_dict() if hasattr(data_source, "state_dict") else None,
    }
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a checkpoint directory is complete or absent
    for old in sorted((out / "checkpoints").glob("step_*"))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def engine_version(url: str, adapter: str | None = None) -> str | None:
    """The weight version an engine reports now (after a push: proof that it took the weights);
    with `adapter`, the version of that adapter (from /server_info's `lora_adapters`). None when
    the engine is unreachable or does not report it."""
    route = "/server_info" if adapter else "/get_weight_version"
    try:
        with urllib.request.urlopen(url.rstrip("/") + route, timeout=10) as resp:
            answer = json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None
    if adapter:
        entry = (answer.get("lora_adapters") or {}).get(adapter)
        return entry.get("weight_version") if isinstance(entry, dict) else None
    return answer.get("weight_version")


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted(p for p in (out / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def push_weights(
    engines: list[str], path: Path, version: int, adapter: str | None = None, deadline_s: float = 300.0
) -> None:
    """Load `path` into every engine of this agent and set its weight version (SGLang's
    /update_weights_from_disk); with `adapter`, `path` is a LoRA adapter, loaded (or replaced)
    under that name with SGLang's /load_lora_adapter, the base model and other adapters untouched.

    An engine that is down (restarting) is retried with backoff until `deadline_s`; one that
    refuses the weights is an error. Runs on the host's event loop, as the rollouts do.
    """
    from mrlx_plugin.core.host import run_in_host_loop

    run_in_host_loop(_push_weights(engines, path, version, adapter, deadline_s))


def _engine_message(raw: bytes) -> str:
    """An engine's reason for a refusal: SGLang's `message` (weights) or `error_message` (adapters)."""
    try:
        answer = json.loads(raw)
    except ValueError:
        return repr(raw[:200])
    if isinstance(answer, dict) and (answer.get("error_message") or answer.get("message")):
        return str(answer.get("error_message") or answer.get("message"))
    return repr(raw[:200])


async def _push_weights(
    engines: list[str], path: Path, version: int, adapter: str | None, deadline_s: float
) -> None:
    if adapter is None:
        route, what = "/update_weights_from_disk", f"the weights at {path}"
        body: JSONObject = {"model_path": str(path), "weight_version": str(version)}
    else:
        route, what = "/load_lora_adapter", f"adapter {adapter!r} at {path}"
        body = {"lora_name": adapter, "lora_path": str(path), "upsert": True, "weight_version": str(version)}
    await _post_all(engines, route, body, what, deadline_s)


async def _post_all(engines: list[str], route: str, body: JSONObject, what: str, deadline_s: float) -> None:
    """POST `body` to `route` of every engine, an engine that is down retried until `deadline_s`;
    a refusal (`what` names what was refused) is a RuntimeError."""
    import asyncio

    import aiohttp

    from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry

    async with aiohttp.ClientSession() as session:
        for url in engines:
            deadline = Deadline(deadline_s)

            async def attempt(_: int, url: str = url, deadline: Deadline = deadline) -> JSONObject:
                timeout = aiohttp.ClientTimeout(total=max(1.0, deadline.remaining()))
                async with session.post(url.rstrip("/") + route, json=body, timeout=timeout) as resp:
                    raw = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} refused {what}: HTTP {resp.status} {_engine_message(raw)}")
                return json.loads(raw or b"{}")

            def on_retry(n: int, exc: BaseException, wait: float, url: str = url) -> None:
                log.warning("engine %s unreachable (%s); retrying %s in %.1fs", url, exc, route, wait)

            try:
                answer = await retry(
                    attempt,
                    deadline=deadline,
                    backoff=Backoff(base_s=0.25, max_s=2.0),
                    on_retry=on_retry,
                    retryable=lambda e: isinstance(e, (aiohttp.ClientConnectionError, asyncio.TimeoutError)),
                )
            except RetriesExhausted as exc:
                raise RuntimeError(
                    f"{url} did not take {what} within {deadline_s:.0f}s: {exc.last}"
                ) from None
            if not answer.get("success", True):
                reason = answer.get("error_message") or answer.get("message")
                raise RuntimeError(f"{url} refused {what}: {reason}")


def trained_adapter(settings: Settings, adapter_dir: str | None) -> str | None:
    """The name the engine serves the trained agent's LoRA adapter under (its `adapter` setting),
    or None when the trainer trains a whole model. `adapter_dir` is --adapter; the two must come
    together, or a push would load weights the agent's requests never name (ConfigError)."""
    from mrlx_plugin.core.config import ConfigError

    agent = settings.self_agent
    if agent is None:
        served = [
            (n, a.adapter)
            for n, a in settings.agents.items()
            if a.trainable and a.url == "self" and a.adapter
        ]
        if served:
            name, lora = served[0]
            raise ConfigError(
                f"mrlx.agents.{name}.adapter: this job trains the engine's whole model (it names no "
                f"mrlx.self), but {name!r} is served as LoRA adapter {lora!r}; train each adapter in a job "
                f"of its own (mrlx.self: the agent, --adapter DIR), or set mrlx.agents.{name}.trainable: "
                "false"
            )
        if adapter_dir is not None:
            raise ConfigError(
                f"--adapter {adapter_dir}: the job names no agent it trains (mrlx.self), so it trains the "
                "engine's whole model; set mrlx.self to the agent this adapter serves"
            )
        return None
    name = getattr(settings.agents.get(agent), "adapter", None)
    if adapter_dir is not None and name is None:
        raise ConfigError(
            f"--adapter {adapter_dir}: the trained agent {agent!r} has no adapter; set "
            f"mrlx.agents.{agent}.adapter to the name its engine serves the adapter under"
        )
    if name is not None and adapter_dir is None:
        raise ConfigError(
            f"mrlx.agents.{agent}.adapter is {name!r}: pass --adapter DIR, the adapter's initial weights "
            "(a peft directory for the base --model)"
        )
    return name


# --- the population's snapshots (`mrlx.game.population`) -----------------------------------------


def population_of(settings: Settings, adapter: str | None) -> PopulationSettings | None:
    """The population of past policies whose snapshots this trainer takes (`mrlx.game.population`
    of a game job), or None. Only the trainer of the population's agent can take them, as LoRA
    adapters: ConfigError when the agent is not the adapter this trainer trains."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.systems.game_pool import population_agent

    game = getattr(settings, "game", None) if settings.system == "game" else None
    pop = getattr(game, "population", None)
    if pop is None:
        return None
    agent = population_agent(settings)
    if adapter is None or agent is None or settings.self_agent != agent:
        what = f"adapter {adapter!r} of agent {settings.self_agent!r}" if adapter else "the whole model"
        raise ConfigError(
            f"mrlx.game.population.agent is {agent!r}, but this trainer trains {what}: the snapshots "
            f"of {agent!r} are taken by the trainer of its adapter; run this config with "
            f"mrlx.self: {agent} and --adapter DIR (its initial adapter), or leave out "
            "mrlx.game.population"
        )
    return pop


@dataclass
class Snapshots:
    """The population's snapshots, kept by the trainer of its agent: the adapter at each snapshot
    version (0, `every`, 2 x `every`, ...: the weight version the trainer pushed, step r-1's weights
    being version r) saved under out/snapshots/v{version} and loaded on every engine under
    `ADAPTER@VERSION`, the last `keep` of them only: those the episodes draw
    (`systems.game_pool.snapshot_versions`); older ones are unloaded and deleted."""

    engines: list[str]
    folder: Path  # out/snapshots
    adapter: str  # the trained adapter's name on the engines
    every: int
    keep: int
    loaded: set[int] = field(default_factory=set)  # the versions loaded on the engines

    def take(self, version: int, source: Path) -> None:
        """The trainer pushed weight version `version` (from the adapter at `source`): a snapshot
        when it is a snapshot version (saved, then loaded), the ones no longer drawn dropped."""
        if version % self.every == 0:
            self.save(version, source)
        self.sync(version)

    def save(self, version: int, source: Path) -> None:
        """out/snapshots/v{version}: the adapter's files at `source` (complete or absent)."""
        final = self.folder / f"v{version}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in source.iterdir():
            if f.is_file() and f.name.startswith("adapter_"):
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def sync(self, version: int) -> None:
        """Serve exactly the snapshots drawn from at weight version `version`: load those not loaded
        (from disk: a resumed trainer's come back this way), unload and delete the older ones.
        A snapshot that should be drawn and is not on disk is a ConfigError."""
        from mrlx_plugin.core.config import ConfigError
        from mrlx_plugin.core.host import run_in_host_loop
        from mrlx_plugin.systems.game_pool import snapshot_versions

        wanted = snapshot_versions(version, self.every, self.keep)
        missing = [v for v in wanted if not (self.folder / f"v{v}").is_dir()]
        if missing:
            raise ConfigError(
                f"mrlx.game.population: the snapshots of weight versions {missing} are drawn from but "
                f"not in {self.folder} (a run resumed with another population than it was saved "
                "under?); resume with the population settings it ran with, or start a new run"
            )
        for v in wanted:
            if v not in self.loaded:
                push_weights(self.engines, self.folder / f"v{v}", version=v, adapter=self.name(v))
                self.loaded.add(v)
        for v in sorted(self.loaded - set(wanted)):
            what = f"the unload of adapter {self.name(v)!r}"
            body: JSONObject = {"lora_name": self.name(v)}
            run_in_host_loop(_post_all(self.engines, "/unload_lora_adapter", body, what, 300.0))
            self.loaded.discard(v)
        for old in self.folder.glob("v*"):  # never drawn again (a resumed run reloads what is kept)
            if old.name[1:].isdigit() and int(old.name[1:]) < wanted[0]:
                shutil.rmtree(old, ignore_errors=True)
        log.info("population: serving snapshots %s of %r", [self.name(v) for v in wanted], self.adapter)

    def name(self, version: int) -> str:
        from mrlx_plugin.systems.game_pool import SNAPSHOT_MARK

        return f"{self.adapter}{SNAPSHOT_MARK}{version}"
