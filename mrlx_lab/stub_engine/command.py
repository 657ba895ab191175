"""`mrlx stub-engine` (`python -m mrlx_lab.stub_engine`): its flags, then serving until
SIGTERM/SIGINT, registered with a router while it serves."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal

from mrlx_lab.stub_engine.answers import DEFAULT_TEXT, StubConfig
from mrlx_lab.stub_engine.server import StubServer
from mrlx_plugin.core.netutil import public_bind_refusal, write_port_file

log = logging.getLogger("mrlx.stub_engine")


def add_stub_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the stub engine's flags to `parser`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the stub has no authentication: trusted networks only)",
    )
    parser.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default: 0)")
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds before each /generate answer (default: 0)"
    )
    parser.add_argument("--response-tokens", type=int, default=64, help="token ids per answer (default: 64)")
    parser.add_argument(
        "--text",
        action="append",
        default=None,
        help="the text of every answer ('{i}' becomes the request number); given N times, the answers "
        "take the N texts in turn",
    )
    parser.add_argument(
        "--pick-by-seed",
        action="store_true",
        help="with several --text: answer a request that has a sampling_seed with the text drawn from "
        "that seed and its prompt (the same seed and prompt, the same answer), not the next in turn",
    )
    parser.add_argument("--weight-version", default="0", help='initial weight version (default: "0")')
    parser.add_argument(
        "--vocab-size", type=int, default=512, help="answer ids lie in [0, vocab-size) (default: 512)"
    )
    parser.add_argument("--eos-id", type=int, default=2, help="id that ends an answer (default: 2)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a directory with tokenizer.json: answers spell --text in its ids (default: byte ids of the "
        "locally built tokenizers)",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="model_path reported by /get_model_info (a local directory, or none)",
    )
    parser.add_argument(
        "--stream-tokens", type=int, default=4, help="tokens per chunk of a streamed answer (default: 4)"
    )
    parser.add_argument(
        "--stream-delay",
        type=float,
        default=0.0,
        help="seconds between the chunks of a streamed answer (default: 0, all at once)",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream what is new in each chunk, not everything so far (SGLang's flag)",
    )
    parser.add_argument("--router-url", default=None, help="register with this sglang-router once up")
    parser.add_argument(
        "--lora-names", nargs="+", default=[], metavar="NAME", help="the LoRA adapters it serves (by name)"
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


async def _serve(args: argparse.Namespace) -> int:

    refusal = public_bind_refusal(args.host, args.allow_remote, "the stub engine")
    if refusal:
        log.error("%s", refusal)
        return 2
    config = StubConfig(
        latency=max(0.0, args.latency),
        response_tokens=max(0, args.response_tokens),
        text=args.text[0] if args.text else DEFAULT_TEXT,
        texts=tuple(args.text or ()),
        pick_by_seed=args.pick_by_seed,
        weight_version=str(args.weight_version),
        vocab_size=max(4, args.vocab_size),
        eos_id=args.eos_id,
        model_path=args.model_path,
        tokenizer=args.tokenizer,
        lora_names=tuple(args.lora_names),
        stream_tokens=max(1, args.stream_tokens),
        stream_delay=max(0.0, args.stream_delay),
        incremental=args.incremental_streaming_output,
    )
    try:
        config.spell()  # load the tokenizer before serving (and fail here, once, if it cannot load)
    except Exception as exc:  # noqa: BLE001 - the loader raises many types; all mean "bad --tokenizer"
        log.error("cannot load a tokenizer from --tokenizer %s: %s", args.tokenizer, exc)
        return 2
    server = StubServer(config)
    loop = asyncio.get_running_loop()
    server.loop = loop
    try:
        srv = await loop.create_server(server.protocol, args.host, args.port, backlog=1024)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        return 2
    port = int(srv.sockets[0].getsockname()[1])
    if args.port_file:
        write_port_file(args.port_file, port)
    log.info("stub engine listening on http://%s:%s", args.host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    register = None
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::', '') else args.host}:{port}"
    if args.router_url:
        from mrlx_plugin.local.engine.router import register_with_router

        register = asyncio.create_task(register_with_router(args.router_url.rstrip("/"), url, stop))
    await stop.wait()
    if register is not None and await register:
        from mrlx_plugin.local.engine.router import deregister_from_router

        await deregister_from_router(args.router_url.rstrip("/"), url)
    srv.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a stub engine with parsed `add_stub_arguments` flags until SIGTERM/SIGINT."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:  # a faster event loop where available; the stock one is fine too
        uvloop = importlib.import_module("uvloop")  # optional: not a dependency
    except ImportError:
        return asyncio.run(_serve(args))
    return uvloop.run(_serve(args))


def main(argv: list[str] | None = None) -> int:
    """`python -m mrlx_lab.stub_engine [--port 0 --port-file F ...]`."""
    parser = add_stub_arguments(
        argparse.ArgumentParser(
            prog="mrlx stub-engine", description="A model-free SGLang-protocol responder."
        )
    )
    return run(parser.parse_args(argv))
