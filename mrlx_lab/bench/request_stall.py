"""`mrlx bench requests`: how long hostile chat-completions requests hold the rollout's event
loop, and what they cost in memory, against the agent endpoint of a real episode.

Each case runs in a fresh rollout process: one episode of agent code (this module's system,
`request_stall`) against the stub engine, whose user function sends the case's request
`--repeat` times (each a distinct body, pre-encoded, so the client's own JSON work is not
counted) through plain HTTP to its agent's endpoint. A probe task on the rollout's event loop
sleeps 1 ms at a time and records the longest gap between its wake-ups: the worst stall any
other episode (and the host's aborts) would have seen. Beside it: the peak RSS growth over the
requests (VmHWM, reset first), the RSS still held after them (a collection run: what caches
keep), and each request's answer. Before the probe starts, one ordinary request warms the
endpoint (the chat template compiled, the tokenizer's tables built).

Cases (context limit 32,768 tokens unless said otherwise):

- 300,000 empty user messages;
- a 6 MB tools list (500 tools of 12 KB), context unbounded;
- a 3 MB tools list, over the context;
- a 1.5 MB tool output (a web page), over the context;
- a body of empty JSON lists, as large as the endpoint reads (`server.MAX_BODY_BYTES`);
- a body of 332,000 empty lists (1 MB, just under the million JSON items a body may hold);
- 4,000 messages (~600 KB), context unbounded: served;
- a 1.5 MB tools list (125 tools of 12 KB), context unbounded: served;
- 10,000 messages and a 1.9 MB tools list (at the endpoint's limits), context unbounded: served;
- an ordinary request (a question and one tool): served.

Goal: the worst stall under 100 ms in every case, refused or served.

    .venv/bin/mrlx bench requests [--repeat 3] [--cases NAME ...] [--out runs/bench/requests.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import orjson

from mrlx_lab.bench.report import write_report
from mrlx_plugin import hookimpl
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    import aiohttp

    from mrlx_plugin.agents import Endpoint, Task

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the value stored under a key",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
USER = {"role": "user", "content": "What is stored under x7?"}
CONTEXT = 32768


def _tool(i: int, tag: int) -> JSONObject:
    """A tool spec of ~12 KB: a long description and 50 described parameters."""
    words = " ".join(f"word{(i * 7 + j) % 997}" for j in range(300))
    props = {
        f"p{j}": {"type": "string", "description": f"parameter {j} of tool {i}: " + words[:150]}
        for j in range(50)
    }
    return {
        "type": "function",
        "function": {
            "name": f"tool_{tag}_{i}",
            "description": words,
            "parameters": {"type": "object", "properties": props, "required": ["p0"]},
        },
    }


def _tools_body(n: int, tag: int) -> bytes:
    return orjson.dumps({"messages": [USER], "tools": [_tool(i, tag) for i in range(n)]})


def _empty_messages(tag: int) -> bytes:
    messages = [{"role": "user", "content": ""}] * 300_000 + [{"role": "user", "content": f"request {tag}"}]
    return orjson.dumps({"messages": messages})


def _tool_output(tag: int) -> bytes:
    page = " ".join(f"w{i % 9973}" for i in range(250_000))  # ~1.5 MB, no blank line
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "x7"}'}}
    messages = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": f"page {tag}: " + page},
    ]
    return orjson.dumps({"messages": messages, "tools": [LOOKUP]})


def _empty_lists(tag: int) -> bytes:
    from mrlx_plugin.agents.server import MAX_BODY_BYTES

    head = b'{"messages":[' + b'{"role":"user","content":"%d"},' % tag
    return head + b",".join([b"[]"] * ((MAX_BODY_BYTES - len(head) - 2) // 3)) + b"]}"


def _many_messages(tag: int) -> bytes:
    messages = []
    for i in range(4000):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(
            {"role": role, "content": f"message {i} of conversation {tag}: " + "lorem ipsum " * 10}
        )
    messages.append({"role": "user", "content": "And now?"})
    return orjson.dumps({"messages": messages})


def _million_items(tag: int) -> bytes:
    head = b'{"messages":[' + b'{"role":"user","content":"%d"}' % tag
    return head + b",[]" * 332_000 + b"]}"


def _at_the_limits(tag: int) -> bytes:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag}: turn {i}"} for i in range(9999)
    ]
    return orjson.dumps({"messages": messages + [USER], "tools": [_tool(i, tag) for i in range(155)]})


def _ordinary(tag: int) -> bytes:
    return orjson.dumps(
        {"messages": [{"role": "user", "content": f"What is stored under x{tag}?"}], "tools": [LOOKUP]}
    )


# name -> (builder of the i-th body, context limit or None)
CASES: dict[str, tuple[Callable[[int], bytes], int | None]] = {
    "300,000 empty messages": (_empty_messages, CONTEXT),
    "6 MB tools list": (lambda tag: _tools_body(500, tag), None),
    "3 MB tools list, over the context": (lambda tag: _tools_body(250, tag), CONTEXT),
    "1.5 MB tool output, over the context": (_tool_output, CONTEXT),
    "empty JSON lists, at the body limit": (_empty_lists, CONTEXT),
    "a million JSON items (332,000 lists)": (_million_items, CONTEXT),
    "4,000 messages, served": (_many_messages, None),
    "1.5 MB tools list, served": (lambda tag: _tools_body(125, tag), None),
    "10,000 messages, 1.9 MB tools, served": (_at_the_limits, None),
    "an ordinary request, served": (_ordinary, CONTEXT),
}

# --- the rollout worker (its own process) ------------------------------------------------------


class _Plan(TypedDict, total=False):
    """What the rollout worker's episode sends (`bodies`) and where it reports (`result`)."""

    bodies: list[bytes]
    result: JSONObject


_PLAN: _Plan = {}


def _proc_status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _post(session: aiohttp.ClientSession, ep: Endpoint, data: bytes) -> tuple[int, str, float]:
    headers = {"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with session.post(ep.base_url + "/chat/completions", data=data, headers=headers) as resp:
        text = await resp.read()
    elapsed = time.perf_counter() - start
    try:
        error = orjson.loads(text).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        error = {"code": "not JSON"}
    return resp.status, str(error.get("code") or ""), elapsed


async def _episode(task: Task, endpoints: dict[str, Endpoint]) -> dict[str, float]:
    import aiohttp

    ep = endpoints["solver"]
    bodies: list[bytes] = _PLAN["bodies"]
    out: JSONObject = _PLAN["result"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _post(session, ep, orjson.dumps({"messages": [{"role": "user", "content": "warm up"}]}))
        gc.collect()
        worst, running = 0.0, True

        async def probe() -> None:
            nonlocal worst
            last = time.perf_counter()
            while running:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                worst = max(worst, now - last - 0.001)
                last = now

        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        before = _proc_status("VmRSS")
        prober = asyncio.ensure_future(probe())
        await asyncio.sleep(0.05)
        answers = []
        for data in bodies:
            answers.append(await _post(session, ep, data))
        await asyncio.sleep(0.05)
        running = False
        await prober
    peak = _proc_status("VmHWM")
    gc.collect()
    out.update(
        worst_stall_s=worst,
        peak_rss_growth_mib=peak - before,
        held_rss_growth_mib=_proc_status("VmRSS") - before,
        answers=[{"status": s, "code": c, "elapsed_s": e} for s, c, e in answers],
    )
    return {"solver": 0.0}


@hookimpl
def mrlx_register_systems():
    from mrlx_plugin.agents import agent_code

    return {"request_stall": agent_code(_episode, samples={"solver": 8}, turns={"solver": 1})}


def worker(ns: argparse.Namespace) -> JSONObject:
    # The system is registered from the module as imported (this file may run as __main__).
    from mrlx_lab.bench import request_stall as module
    from mrlx_plugin.core.host import Sample
    from mrlx_plugin.local.trainer.fake_host import add_host_arguments, host_args, sampling_params, set_router
    from mrlx_plugin.rollout import generate
    from mrlx_plugin.runtime import get_runtime

    build, context = CASES[ns.case]
    module._PLAN["bodies"] = [build(i) for i in range(ns.repeat)]
    module._PLAN["result"] = result = {"body_mib": len(module._PLAN["bodies"][0]) / 2**20}
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    host = parser.parse_args([])
    host.hf_checkpoint = ns.tokenizer
    args = host_args(host, None)
    set_router(args, ns.url)
    args.rollout_max_context_len = args.eval_max_context_len = context
    args.rollout_max_response_len = 64
    args.mrlx = {
        "run_id": "bench-requests",
        "plugins": ["mrlx_lab.bench.request_stall"],
        "system": "request_stall",
        "agents": {"solver": {"url": "self"}},
        "engine": {"max_retries": 0, "request_timeout_s": 300},
        "request_stall": {"timeout_s": 3600},
    }

    async def run() -> None:
        try:
            await generate(
                args, Sample(group_index=0, index=0, prompt="x", label="42"), sampling_params(args)
            )
        finally:
            await (await get_runtime(args)).aclose()

    asyncio.run(run())
    return result


# --- the driver ----------------------------------------------------------------------------------


def _run_case(case: str, url: str, tokenizer: str, repeat: int) -> JSONObject:
    from mrlx_plugin.core import processes

    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    argv = [sys.executable, "-m", "mrlx_lab.bench.request_stall", "--worker", case]
    argv += ["--url", url, "--tokenizer", tokenizer, "--repeat", str(repeat), "--result", out]
    proc = processes.start(argv)
    try:
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv)
    finally:
        processes.stop(proc)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def _outcome(answers: list[JSONObject]) -> str:
    counts = Counter(f"{a['status']} {a['code']}".strip() for a in answers)
    return "; ".join(f"{k} x{n}" for k, n in counts.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mrlx bench requests", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=3, help="requests per case (distinct bodies)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), metavar="CASE")
    p.add_argument("--out", default="runs/bench/requests.json", help="write the numbers as JSON here")
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker is not None:
        ns.case = ns.worker
        Path(ns.result).write_text(json.dumps(worker(ns)))
        return 0

    from mrlx_lab.stub_engine import start_stub_engine
    from mrlx_plugin.local.model import build_tokenizer

    workdir = Path(ns.workdir)
    tok_dir = workdir / "tokenizer-8k"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(tok_dir, vocab_size=8192)
    extra = ["--response-tokens", "32", "--vocab-size", "8192", "--tokenizer", str(tok_dir)]
    stub = start_stub_engine(log_dir=workdir / "logs", name="stub-requests", extra=extra + ["--text", "42."])
    rows = []
    print(
        f"mrlx bench requests  ({ns.repeat} distinct request(s) a case, each case in a fresh rollout process)"
    )
    print(
        f"  {'request':<38}{'body MiB':>9}{'worst stall':>13}{'slowest answer':>16}{'peak RSS +':>12}"
        f"{'held RSS +':>12}  answers"
    )
    try:
        for case in ns.cases:
            r = _run_case(case, stub.url, str(tok_dir), ns.repeat)
            slowest = max(a["elapsed_s"] for a in r["answers"])
            rows.append({"case": case, **r, "slowest_answer_s": slowest})
            memory = f"{r['peak_rss_growth_mib']:>9.0f}MiB{r['held_rss_growth_mib']:>9.0f}MiB"
            print(
                f"  {case:<38}{r['body_mib']:>9.1f}{r['worst_stall_s'] * 1000:>11.0f}ms{slowest:>15.2f}s"
                f"{memory}  {_outcome(r['answers'])}"
            )
    finally:
        stub.stop()
    worst = max(r["worst_stall_s"] for r in rows)
    print(f"  goal: worst stall < 100 ms in every case (worst here: {worst * 1000:.0f} ms)")
    write_report(ns.out, {"repeat": ns.repeat, "context_limit": CONTEXT, "cases": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
