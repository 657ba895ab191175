"""Grading math answers: a fast exact path, and math-verify in a worker process for the rest.

Most answers can be settled without a computer-algebra system: the boxed (or "final answer")
text equals the label after light normalisation, or both are plain numbers. The rest go to
math-verify. math-verify can take unbounded time on adversarial input and its own timeouts use
SIGALRM, which only works on a main thread (slime runs rollouts on a background thread), so it
runs in a separate worker process that is killed and replaced when a grade overruns its
deadline. The event loop never blocks on grading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from collections import OrderedDict
from fractions import Fraction
from typing import cast

from mrlx_plugin.core.processes import start_async
from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry

logger = logging.getLogger(__name__)

_BOXED = ("\\boxed", "\\fbox")
_FINAL_PATTERNS = [
    re.compile(r"final answer\s*(?:is|:)\s*(.+)", re.IGNORECASE),
    re.compile(r"answer\s*(?:is|:)\s*(.+)", re.IGNORECASE),
    re.compile(r"^####\s*(.+)$", re.MULTILINE),
]
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")
_SLASH = re.compile(r"^([-+]?\d+)/(\d+)$")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces matched; None if there is none."""
    start = max(text.rfind(b) for b in _BOXED)
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    """The answer a response commits to: its last boxed expression, else a 'final answer' line."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in _FINAL_PATTERNS:
        matches = pattern.findall(text)
        if matches:
            return matches[-1].strip().split("\n")[0].rstrip(".").strip()
    return None


def normalize_answer(s: str) -> str:
    s = s.strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", " "):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    return s.rstrip(".")


def as_number(s: str) -> Fraction | None:
    """A plain integer, decimal or integer fraction as an exact Fraction; None otherwise."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _NUMBER.match(s):
        return Fraction(s)
    m = _FRAC.match(s) or None
    if m:
        sign, num, den = m.groups()
        value = Fraction(int(num), int(den)) if int(den) else None
        return -value if (value is not None and sign == "-") else value
    m = _SLASH.match(s)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def quick_grade(response: str, label: object) -> float | None:
    """1.0 or 0.0 when the answer can be settled without algebra; None when math-verify must decide.

    No label (or an empty one) grades 0.0: there is nothing to be right about.
    """
    if label is None or str(label).strip() == "":
        return 0.0
    answer = extract_answer(response)
    if answer is None:
        return None
    a, g = normalize_answer(answer), normalize_answer(str(label))
    if not a:
        return 0.0
    if a == g:
        return 1.0
    na, ng = as_number(a), as_number(g)
    if na is not None and ng is not None:
        return 1.0 if na == ng else 0.0
    return None


# --------------------------------------------------------------------------------------------
# math-verify in a worker process
# --------------------------------------------------------------------------------------------


def _worker_main() -> None:  # pragma: no cover - runs in the worker process
    """Read `{"id", "label", "response"}` lines on stdin, write `{"id", "ok"}` lines on stdout."""
    logging.disable(logging.WARNING)
    from math_verify import parse, verify

    for line in sys.stdin:
        req = json.loads(line)
        try:
            gold = parse(f"${req['label']}$")
            if not gold:
                gold = parse(req["label"])
            answer = extract_answer(req["response"])
            target = parse(f"\\boxed{{{answer}}}") if answer is not None else parse(req["response"][-400:])
            ok = bool(gold) and bool(target) and bool(verify(gold, target))
        except Exception:  # noqa: BLE001 - any failure to parse is a wrong answer
            ok = False
        sys.stdout.write(json.dumps({"id": req["id"], "ok": ok}) + "\n")
        sys.stdout.flush()


class MathVerifier:
    """One long-lived math-verify worker process, fed over a pipe, with per-grade deadlines."""

    def __init__(self, timeout_s: float = 10.0, cache_size: int = 65536):
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._start_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_size = cache_size
        self.timeouts = 0

    async def _ensure_worker(self) -> asyncio.subprocess.Process:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop: the old pipes belong to the old one
            self._proc, self._reader, self._pending, self._start_lock = None, None, {}, asyncio.Lock()
            self._loop = loop
        async with cast(asyncio.Lock, self._start_lock):  # set above for this loop
            if self._proc is None or self._proc.returncode is not None:
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                # tied: the worker goes with this process however it dies (also by SIGKILL)
                self._proc = await start_async(
                    [
                        sys.executable,
                        "-c",
                        "from mrlx_plugin.rewards.grading import _worker_main; _worker_main()",
                    ],
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    env=env,
                )
                self._pending = {}  # owned by this worker's reader from now on
                self._reader = asyncio.ensure_future(self._read(self._proc, self._pending))
            return self._proc

    async def _read(self, proc: asyncio.subprocess.Process, pending: dict[int, asyncio.Future]) -> None:
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            fut = pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(bool(msg.get("ok")))
        for fut in pending.values():  # the worker died: its graders retry on a new one
            if not fut.done():
                fut.set_exception(ConnectionError("math-verify worker exited"))
        pending.clear()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
        self._proc = None

    async def verify(self, response: str, label: str) -> bool:
        key = (label, response[-2000:])
        hit = self._cache.get(key)
        if hit is not None:
            return hit

        async def attempt(_: int) -> bool:
            proc = await self._ensure_worker()
            self._next_id += 1
            req_id = self._next_id
            fut = asyncio.get_running_loop().create_future()
            self._pending[req_id] = fut
            assert proc.stdin is not None
            proc.stdin.write(
                (json.dumps({"id": req_id, "label": label, "response": response}) + "\n").encode()
            )
            try:
                await proc.stdin.drain()
                return await asyncio.wait_for(fut, self.timeout_s)
            except asyncio.TimeoutError:
                self.timeouts += 1
                logger.warning("math-verify took over %.1fs on an answer; counted as wrong", self.timeout_s)
                self._pending.pop(req_id, None)
                self._kill()
                return False
            except ConnectionError:  # the worker died (BrokenPipeError included): once more on a new one
                self._pending.pop(req_id, None)
                raise

        try:
            ok = await retry(
                attempt, retryable=_worker_died, deadline=Deadline(None), backoff=_AT_ONCE, max_retries=1
            )
        except RetriesExhausted:
            ok = False
        self._cache[key] = ok
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ok

    async def aclose(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        self._proc = None


# A grade whose worker died is sent again at once to the worker that replaces it: no wait helps.
_AT_ONCE = Backoff(base_s=0.0, max_s=0.0)


def _worker_died(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


async def grade_math(response: str, label: object, verifier: MathVerifier) -> float:
    """1.0 when `response` commits to an answer equal to `label`, else 0.0."""
    quick = quick_grade(response, label)
    if quick is not None:
        return quick
    return 1.0 if await verifier.verify(response, str(label)) else 0.0
