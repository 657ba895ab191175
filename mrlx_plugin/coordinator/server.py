"""The coordinator's command line (`mrlx coordinator`, `python -m mrlx_plugin.coordinator.server`):
its options, checked into a `CoordinatorConfig`, and serving until interrupted (`serve`). The
service itself is `service.Coordinator`; the package's docstring lists its routes."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import re
import signal
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import disable_created_metrics

from mrlx_plugin.coordinator.config import (
    IDLE_TIMEOUT_S,
    MAX_COMMIT_ITEMS,
    MAX_CONNECTIONS,
    MAX_DELIVERIES,
    MAX_FRAME_BATCHES,
    MAX_FRAME_MESSAGE_BYTES,
    CoordinatorConfig,
)
from mrlx_plugin.coordinator.connections import LISTEN_BACKLOG, ConnectionGuard, connection_cap
from mrlx_plugin.coordinator.database import StoreOpenError
from mrlx_plugin.coordinator.service import Coordinator
from mrlx_plugin.coordinator.storage import CoordinatorStore
from mrlx_plugin.core.netutil import is_loopback, write_port_file
from mrlx_plugin.link.auth import token_from_env_or_file

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The coordinator's options, for `mrlx coordinator` and `python -m mrlx_plugin.coordinator.server`."""
    parser.add_argument(
        "--db",
        required=True,
        help="SQLite file on a local disk (created if missing); it and its -wal and -shm files are "
        "owner-only (0600): looser modes found at start are tightened, and the log says so",
    )
    parser.add_argument("--run-id", required=True, help="the run this coordinator serves")
    parser.add_argument("--agents", required=True, help="comma-separated agent names, e.g. doctor,patient")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)"
    )
    parser.add_argument("--port", type=int, default=18888, help="port (0: any free port, see --port-file)")
    parser.add_argument(
        "--token-env",
        default="MRLX_TOKEN",
        help="environment variable holding the run's token (calls are "
        "signed with keys derived from it; the token itself never travels)",
    )
    parser.add_argument(
        "--token-file", default=None, help="file holding the run's token (instead of --token-env)"
    )
    parser.add_argument(
        "--max-depth", type=int, default=65536, help="most unacked items per queue before commits get 429"
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=512.0,
        help="largest request body in MB (413 above). A commit's frame also gets 413, before any item "
        f"is unpacked, past {MAX_COMMIT_ITEMS} items, {MAX_FRAME_BATCHES} "
        f"record batches, or {MAX_FRAME_MESSAGE_BYTES >> 10} KiB of metadata in one message (the frame "
        "header's included)",
    )
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once ready")
    parser.add_argument(
        "--synchronous",
        choices=("full", "normal"),
        default="full",
        help=(
            "SQLite sync mode: full fsyncs every commit (survives power loss); normal survives process kills"
        ),
    )
    parser.add_argument(
        "--max-db-mb", type=float, default=None, help="cap on the database size; commits past it get 507"
    )
    parser.add_argument(
        "--max-deliveries",
        type=int,
        default=MAX_DELIVERIES,
        help="a group leased this many times and never acknowledged is set aside (dead-lettered: kept, "
        f"counted, never delivered again) (default {MAX_DELIVERIES})",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="close a connection that has not sent a complete request header for this long, counted "
        f"from its start or from its last answer (default {IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--metrics-token-env",
        default=None,
        help="environment variable holding a second, read-only token that opens GET /metrics alone, sent "
        "as `Authorization: Bearer ...` (for a Prometheus scraper, which cannot sign requests); unset: "
        "/metrics takes signed calls only",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="most open connections; past it the connection idle the longest is closed (default "
        f"{MAX_CONNECTIONS}, lowered to fit the open-file limit RLIMIT_NOFILE)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """A validated config from parsed options; raises ValueError with the option named."""
    agents = [a.strip() for a in str(args.agents).split(",") if a.strip()]
    if not agents:
        raise ValueError("--agents: give at least one agent name, e.g. --agents doctor,patient")
    for name in agents:
        if not NAME_PATTERN.match(name):
            raise ValueError(
                f"--agents: {name!r} is not a valid agent name (letters, digits, _ . -; at most 64)"
            )
    if len(set(agents)) != len(agents):
        raise ValueError(f"--agents: names repeat in {args.agents!r}")
    if not NAME_PATTERN.match(args.run_id):
        raise ValueError(f"--run-id: {args.run_id!r} is not valid (letters, digits, _ . -; at most 64)")
    if args.max_depth < 1:
        raise ValueError("--max-depth must be at least 1")
    if args.max_deliveries < 1:
        raise ValueError("--max-deliveries must be at least 1")
    if not (math.isfinite(args.max_request_mb) and args.max_request_mb > 0):
        raise ValueError("--max-request-mb must be a positive number")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port number")
    if not (math.isfinite(args.idle_timeout_s) and args.idle_timeout_s > 0):
        raise ValueError("--idle-timeout-s must be a positive number of seconds")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    token = token_from_env_or_file(args.token_env, args.token_file)
    metrics_token = token_from_env_or_file(args.metrics_token_env, None) if args.metrics_token_env else None
    if args.metrics_token_env and not metrics_token:
        raise ValueError(f"--metrics-token-env: ${args.metrics_token_env} is unset or empty")
    if metrics_token is not None and token is not None and hmac.compare_digest(metrics_token, token):
        raise ValueError(
            "--metrics-token-env: the metrics token must differ from the run's token (it is sent as is)"
        )
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"refusing to listen on {args.host!r} without a token: anyone who can reach it could inject "
            "training "
            f"data. Set ${args.token_env} (or --token-file), or bind to 127.0.0.1"
        )
    return CoordinatorConfig(
        db=args.db,
        run_id=args.run_id,
        agents=agents,
        host=args.host,
        port=args.port,
        token=token,
        metrics_token=metrics_token,
        max_depth=args.max_depth,
        max_request_mb=args.max_request_mb,
        port_file=args.port_file,
        synchronous=args.synchronous,
        max_db_mb=args.max_db_mb,
        max_deliveries=args.max_deliveries,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
    )


class OneLineBadRequests(logging.Filter):
    """A request that is not valid HTTP is the client's fault: one warning line, not a traceback
    at ERROR (which would read as a fault of the coordinator)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            record.msg, record.args, record.exc_info, record.exc_text = (
                "refused a malformed request: %s",
                (first,),
                None,
                None,
            )
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def serve(config: CoordinatorConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run the coordinator until SIGINT/SIGTERM (or `stop` is set)."""
    store, state = await CoordinatorStore.open(
        config.db, config.run_id, synchronous=config.synchronous, max_db_mb=config.max_db_mb
    )
    coordinator = Coordinator(config, store, state)
    runner = web.AppRunner(
        coordinator.build_app(),
        access_log=None,
        handle_signals=False,
        auto_decompress=False,
        keepalive_timeout=config.idle_timeout_s,
    )
    try:
        await runner.setup()
        assert runner.server is not None
        ConnectionGuard(runner.server, connection_cap(config.max_connections), config.idle_timeout_s)
        site = web.TCPSite(runner, config.host, config.port, reuse_address=True, backlog=LISTEN_BACKLOG)
        await site.start()
        port = config.port
        for sock in getattr(site._server, "sockets", None) or []:  # the port actually bound (for --port 0)
            port = sock.getsockname()[1]
            break
        if config.port_file:
            write_port_file(config.port_file, port)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(
            f"mrlx coordinator ready: run {config.run_id!r} at http://{host}:{port} "
            f"(agents {','.join(config.agents)}; db {config.db}; auth {'on' if config.token else 'off'})",
            flush=True,
        )
        await stop.wait()
    finally:
        await runner.cleanup()
        await store.close()


def main(argv: list[str] | None = None) -> int:
    """`mrlx coordinator ...`: parse options, check them, serve until interrupted (`mrlx coordinator
    call METHOD PATH`: one signed request to a running coordinator, see `mrlx_plugin.link.auth`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["call"]:
        from mrlx_plugin.link.auth import call_main

        return call_main(argv[1:])
    parser = add_coordinator_arguments(
        argparse.ArgumentParser(
            prog="mrlx coordinator",
            description="Run the mrlx coordinator for one training run. (`mrlx coordinator call METHOD PATH "
            "--url URL`: send one signed request to a running one and print its answer; see its --help.)",
        )
    )
    args = parser.parse_args(argv)
    # Counters as Prometheus' text format has them (no `_created` twin per series); this process
    # is the coordinator's own, so the switch reaches no other registry.
    disable_created_metrics()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"mrlx coordinator: {exc}", file=sys.stderr)
        return 2
    if config.token is None:
        print(
            f"mrlx coordinator: WARNING: no token (${args.token_env} unset, no --token-file); "
            f"any local process can use this coordinator",
            file=sys.stderr,
            flush=True,
        )
    try:
        asyncio.run(serve(config))
    except StoreOpenError as exc:
        print(f"mrlx coordinator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mrlx coordinator: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
