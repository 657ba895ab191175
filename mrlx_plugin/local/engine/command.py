"""`mrlx engine` (`python -m mrlx_plugin.local.engine`): its flags, then loading the model and its
adapters, serving `EngineServer` until SIGTERM/SIGINT, registered with a router while it serves."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import cast

from aiohttp import web

from mrlx_plugin.core.netutil import public_bind_refusal, write_port_file
from mrlx_plugin.local.engine.adapters import adapter_refusal
from mrlx_plugin.local.engine.batcher import BatchWorker, load_torch
from mrlx_plugin.local.engine.router import deregister_from_router, register_with_router
from mrlx_plugin.local.engine.server import EngineServer

log = logging.getLogger("mrlx.engine")


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags to `parser` (used by `mrlx engine` and by `main`)."""
    parser.add_argument(
        "--model", required=True, help="model directory (from_pretrained layout, with its tokenizer)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the engine has no authentication: trusted networks only)",
    )
    parser.add_argument(
        "--port", type=int, default=0, help="port to listen on; 0 picks a free one (default: 0)"
    )
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    parser.add_argument(
        "--router-url",
        default=None,
        help="register with this sglang-router (POST /add_worker) once up, leave it on shutdown",
    )
    parser.add_argument(
        "--max-batch", type=int, default=32, help="most sequences decoded together (default: 32)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default: 0)")
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths), as SGLang"
    )
    parser.add_argument(
        "--lora-paths",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="LoRA adapters (peft directories) to serve from the start, each under its name (SGLang's flag)",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream what is new in each chunk, not everything so far (SGLang's flag)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


class _QuietProbes(logging.Filter):
    """Drop aiohttp's tracebacks for the router's HTTP/2 probe ("PRI * HTTP/2.0"), which is
    expected: the router falls back to HTTP/1.1 at once."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI" in str(exc))


def _checked_adapters(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """The flags checked before anything loads: the (name, directory) of each `--lora-paths`
    adapter, or None after logging what is wrong."""
    refusal = public_bind_refusal(args.host, args.allow_remote, "the embedded engine")
    if refusal:
        log.error("%s", refusal)
        return None
    if args.max_batch < 1:
        log.error("--max-batch must be >= 1, got %s", args.max_batch)
        return None
    if not (Path(args.model) / "config.json").is_file():
        log.error(
            "--model %s is not a model directory (no config.json); save one with from_pretrained's layout, "
            "e.g. mrlx_plugin.local.model.ensure_model(DIR)",
            args.model,
        )
        return None
    adapters = []
    for spec in args.lora_paths:
        name, sep, path = spec.partition("=")
        if not sep or not name or not (Path(path) / "adapter_config.json").is_file():
            log.error(
                "--lora-paths %s: expected NAME=DIR, DIR a LoRA adapter directory (with adapter_config.json)",
                spec,
            )
            return None
        refusal = adapter_refusal(Path(path) / "adapter_config.json")
        if refusal:
            log.error("--lora-paths %s: %s", spec, refusal)
            return None
        adapters.append((name, path))
    return adapters


async def _load_worker(args: argparse.Namespace, adapters: list[tuple[str, str]]) -> BatchWorker | None:
    """The model, its tokenizer and its adapters loaded (off the event loop) into a `BatchWorker`,
    not started yet; None after logging why they did not load."""
    from mrlx_plugin.local.model import load_model, load_tokenizer

    loop = asyncio.get_running_loop()
    try:
        model, tokenizer = await loop.run_in_executor(
            None, lambda: (load_model(args.model), load_tokenizer(args.model))
        )
    except Exception as exc:  # noqa: BLE001 - reported as one line and exit code 2
        log.error("cannot load the model and its tokenizer from %s: %s", args.model, exc)
        return None
    worker = BatchWorker(
        model,
        tokenizer,
        model_path=str(args.model),
        max_batch=args.max_batch,
        seed=args.seed,
        enable_lora=args.enable_lora or bool(adapters),
    )
    try:
        await loop.run_in_executor(None, worker.load_adapters, adapters)
    except Exception as exc:  # noqa: BLE001 - reported as one line and exit code 2
        log.error("--lora-paths: %s", exc)
        return None
    return worker


async def _until_stopped(server: EngineServer, router_url: str | None) -> bool:
    """Serve until SIGTERM/SIGINT, or until the worker thread dies (True), registered with the
    router at `router_url` (if any) meanwhile."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on the main thread
            pass
    router = router_url.rstrip("/") if router_url else None
    register_task = asyncio.create_task(register_with_router(router, server.url, stop)) if router else None
    worker_died = False
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            if not server.worker.alive:
                log.error("engine worker died; shutting down")
                worker_died = True
                stop.set()
    log.info("shutting down")
    if register_task is not None and router is not None and await register_task:
        await deregister_from_router(router, server.url)
    return worker_died


async def _serve(args: argparse.Namespace) -> int:
    adapters = _checked_adapters(args)
    if adapters is None:
        return 2
    torch = load_torch()
    if args.threads:
        torch.set_num_threads(args.threads)
    worker = await _load_worker(args, adapters)
    if worker is None:
        return 2
    worker.start()
    # A router must reach the engine at an address it can dial, never at a wildcard.
    advertise = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    server = EngineServer(
        worker,
        host=args.host,
        advertise_host=advertise,
        threads=torch.get_num_threads(),
        incremental_streaming=args.incremental_streaming_output,
    )
    logging.getLogger("aiohttp.server").addFilter(_QuietProbes())
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        worker.stop()
        await runner.cleanup()
        return 2
    bound = cast("asyncio.Server | None", site._server)  # a TCPSite serves through an asyncio.Server
    sockets = bound.sockets if bound else []
    server.port = int(sockets[0].getsockname()[1])
    if args.port_file:
        write_port_file(args.port_file, server.port)
    log.info(
        "engine serving %s at http://%s:%s (max batch %s, %s threads)",
        args.model,
        args.host,
        server.port,
        args.max_batch,
        torch.get_num_threads(),
    )
    worker_died = await _until_stopped(server, args.router_url)
    await asyncio.get_running_loop().run_in_executor(None, worker.stop)
    await runner.cleanup()
    return 1 if worker_died else 0


def run(args: argparse.Namespace) -> int:
    """Run an engine with parsed `add_engine_arguments` flags until SIGTERM/SIGINT; exit code."""
    # Never reach for a model hub: everything this engine loads is a local directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - older transformers
        pass
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> int:
    """`python -m mrlx_plugin.local.engine --model DIR [...]`."""
    parser = add_engine_arguments(
        argparse.ArgumentParser(
            prog="mrlx engine", description="A CPU engine speaking SGLang's HTTP protocol."
        )
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
