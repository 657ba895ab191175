"""How long one hostile engine answer holds the rollout's event loop, and what it costs in memory.

An engine (or anything answering on its URL) answers every `/generate` with a 200 answer made
of tiny log-prob entries (`[0,0],` repeated), the answer that costs the most Python objects per
byte, sized three ways for a request of `max_new_tokens` N:
- 32 MiB (the client's absolute limit), with its Content-Length;
- the most bytes an answer to N tokens may take (`answer_limits`), sent chunked (no length);
- the most JSON values such an answer may hold (it is parsed, then refused for its entries).
For contrast, the same round runs against a well-formed N-token answer. `--concurrent` (default
8) calls are in flight at once, as episodes of a rollout are. A probe task on the same event
loop sleeps 1 ms at a time and records the longest gap between its wake-ups: the worst stall any
other episode would have seen. The peak RSS growth of the process (VmHWM, reset before each
round) is reported beside it.

The answering server is a separate process, so its work does not count against the probe.

    .venv/bin/mrlx bench answers [--tokens 1024 32768] [--concurrent 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import socketserver
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from mrlx_lab.bench.report import write_report
from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.engine_client import MAX_BODY_BYTES, EngineClient, EngineError
from mrlx_plugin.core.sglang import answer_limits
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

HEAD = b'{"text":"","meta_info":{"finish_reason":{"type":"length"},"output_token_logprobs":['


def hostile_body(entries: int) -> bytes:
    return HEAD + b",".join([b"[0,0]"] * max(1, entries)) + b"]}}"


def hostile_bodies(tokens: int) -> list[tuple[str, bytes, bool]]:
    """(name, body, chunked) of the hostile answers for a request of `tokens` new tokens."""
    size, values = answer_limits(tokens)
    return [
        ("32 MiB of [0,0] entries", hostile_body((MAX_BODY_BYTES - len(HEAD)) // 6), False),
        (
            "byte allowance of [0,0], chunked",
            hostile_body((min(size, MAX_BODY_BYTES) - len(HEAD)) // 6),
            True,
        ),
        ("value allowance of [0,0]", hostile_body((values - 8) // 4), False),
    ]  # 4 delimiters an entry


def wellformed_body(tokens: int) -> bytes:
    rng = random.Random(0)
    entries = [[-rng.random() * 3, rng.randrange(150_000), None] for _ in range(tokens)]
    return orjson.dumps(
        {
            "text": " word" * tokens,
            "meta_info": {
                "finish_reason": {"type": "length"},
                "output_token_logprobs": entries,
                "prompt_tokens": 3,
            },
        }
    )


def _serve(body: bytes, chunked: bool, ready: Connection) -> None:
    if chunked:  # the body in 64 KiB chunks, no length declared: the client learns its size by reading
        parts = [body[i : i + 65536] for i in range(0, len(body), 65536)]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        answer = head + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"
    else:
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return
                    head += line
                length = next(
                    (
                        int(x.split(b":")[1])
                        for x in head.split(b"\r\n")
                        if x.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.rfile.read(length)
                try:
                    self.wfile.write(answer)
                except OSError:
                    return  # the client hung up (it refused the answer)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True
        request_queue_size = 128  # every concurrent call connects at once

    with Server(("127.0.0.1", 0), Handler) as server:
        ready.send(server.server_address[1])
        server.serve_forever()


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one_round(url: str, concurrent: int, max_new_tokens: int) -> JSONObject:
    client = EngineClient(url, EngineSettings(max_retries=0, request_timeout_s=600.0))
    worst = 0.0
    stop = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.001)
            last = now

    async def call() -> str:
        try:
            await client.generate([1, 2, 3], {"max_new_tokens": max_new_tokens})
            return "ok"
        except EngineError as exc:
            return exc.reason[:120]

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    before = peak_rss_mib()
    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(call() for _ in range(concurrent)))
    elapsed = time.perf_counter() - started
    stop.set()
    await prober
    await client.close()
    return {
        "worst_stall_s": worst,
        "elapsed_s": elapsed,
        "peak_rss_growth_mib": peak_rss_mib() - before,
        "outcome": sorted(set(outcomes)),
    }


def run(body: bytes, chunked: bool, concurrent: int, max_new_tokens: int) -> JSONObject:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(body, chunked, child), daemon=True)
    server.start()
    try:
        port = parent.recv()
        return asyncio.run(one_round(f"http://127.0.0.1:{port}", concurrent, max_new_tokens))
    finally:
        server.kill()
        server.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mrlx bench answers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 32768], help="max_new_tokens of the calls")
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--out", default="runs/bench/answers.json", help="write the numbers as JSON here")
    ns = p.parse_args(argv)
    rows = []
    print(
        f"{'answer':<34} {'MiB':>6} {'max_new':>8} {'worst stall':>12} {'elapsed':>9} {'peak RSS +':>11}  "
        "outcome"
    )
    for tokens in ns.tokens:
        for name, body, chunked in [*hostile_bodies(tokens), ("well-formed", wellformed_body(tokens), False)]:
            r = run(body, chunked, ns.concurrent, tokens)
            rows.append({"answer": name, "mib": len(body) / 2**20, "max_new_tokens": tokens, **r})
            print(
                f"{name:<34} {len(body) / 2**20:>6.1f} {tokens:>8} {r['worst_stall_s'] * 1000:>10.1f}ms "
                f"{r['elapsed_s']:>8.2f}s {r['peak_rss_growth_mib']:>9.0f}MiB  "
                f"{'; '.join(r['outcome'])[:90]}"
            )
    write_report(ns.out, {"concurrent": ns.concurrent, "rounds": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
