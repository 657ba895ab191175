"""Shared fixtures: a small model built on this machine, and the processes that serve it.

Everything runs as real processes on 127.0.0.1 (engine, stub engine, router, coordinator); the
fixtures stop them at the end of their scope.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The repository (examples) and tests/ (the helper modules _coord_procs, _twojobs, ...)
# are importable through pytest's `pythonpath` setting in pyproject.toml. The stand-in hosts under
# tests/hosts/ are not: they are `slime`/`miles` only in the subprocesses that put them on PYTHONPATH.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny causal LM and its tokenizer, built from a config and saved (never downloaded)."""
    from mrlx_plugin.local.model import ensure_model

    return Path(ensure_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def engine(tiny_model_dir, logs_dir):
    """The embedded engine serving the tiny model (one per test session)."""
    from mrlx_plugin.local.services import start_engine

    proc = start_engine(tiny_model_dir, log_dir=logs_dir, extra=["--seed", "0"], threads=1)
    yield proc
    proc.stop()


@pytest.fixture
def stub_engine(logs_dir, request):
    """A fresh model-free responder per test (fault injection state is per process)."""
    from mrlx_lab.stub_engine import start_stub_engine

    proc = start_stub_engine(log_dir=logs_dir, name=f"stub-{request.node.name[:40]}")
    yield proc
    proc.stop()


@pytest.fixture
def stubs_with(logs_dir, request):
    """`stubs_with(*flags)`: a started stub engine with those flags (`--text`, `--pick-by-seed`,
    `--lora-names`, ...); every one started is stopped when the test ends."""
    from mrlx_lab.stub_engine import start_stub_engine

    started = []

    def start(*flags: str):
        name = f"stub-{request.node.name[:30]}-{len(started)}"
        started.append(start_stub_engine(log_dir=logs_dir, name=name, extra=list(flags)))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def engine_for(logs_dir, tiny_model_dir, request):
    """`engine_for(*texts, tokens=80, extra=())`: a stub engine answering the texts in turn (the
    tiny model's tokenizer; `extra`: more of its flags), behind a recording proxy
    (`tests/_recorder.py`) that keeps every `/generate` for the test to check samples against."""
    from _recorder import RecordingProxy

    from mrlx_lab.stub_engine import start_stub_engine

    started = []

    def start(*texts: str, tokens: int = 80, extra: tuple[str, ...] = ()):
        flags = ["--response-tokens", str(tokens), "--tokenizer", str(tiny_model_dir), *extra]
        for text in texts:
            flags += ["--text", text]
        name = f"scripted-{request.node.name[:30]}-{len(started)}"
        started.append(start_stub_engine(log_dir=logs_dir, name=name, extra=flags))
        return RecordingProxy(started[-1].url).start()

    yield start
    for stub in started:
        stub.stop()


@pytest.fixture
def start_coordinator(tmp_path):
    """Start coordinators: `start_coordinator(**options)` is a started `_coord_procs.CoordinatorProcess`
    (the options its constructor takes; `start=False` for one the test starts itself). Each has its
    own directory under the test's tmp_path; all are stopped when the test ends."""
    from _coord_procs import CoordinatorProcess

    started: list[CoordinatorProcess] = []

    def start(*, start: bool = True, cls: type[CoordinatorProcess] = CoordinatorProcess, **options):
        proc = cls(tmp_path / f"coordinator{len(started)}", **options)
        started.append(proc)
        return proc.start() if start else proc

    yield start
    for proc in started:
        proc.stop()
