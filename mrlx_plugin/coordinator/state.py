"""What the coordinator service keeps between requests (weight versions, heartbeats, ended
queues, the events long polls wait on) and what every handler shares: the checks of a request's
run, agent and identity, heartbeats to the file, JSON bodies in and out."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
from aiohttp import web

from mrlx_plugin.coordinator.access import RequestSigning
from mrlx_plugin.coordinator.bodies import B, HttpProblem, parse_body
from mrlx_plugin.coordinator.config import HEARTBEAT_FLUSH_S, CoordinatorConfig
from mrlx_plugin.coordinator.database import StoreError
from mrlx_plugin.coordinator.metrics import Metrics
from mrlx_plugin.coordinator.storage import CoordinatorStore, LoadedState
from mrlx_plugin.link.wire import BufferPool

log = logging.getLogger("mrlx.coordinator")

AGENT_HEADER, PID_HEADER, HOST_HEADER = "X-Mrlx-Agent", "X-Mrlx-Pid", "X-Mrlx-Host"


def seen_phrase(beat: tuple[float, int | None, str | None] | None, now: float) -> str:
    """When an agent was last seen and as which process, for messages."""
    if beat is None:
        return "never seen"
    seen, pid, host = beat
    who = []
    if pid is not None:
        who.append(f"pid {pid}")
    if host:
        who.append(f"on host {host}")
    return f"last seen {max(0.0, now - seen):.1f} s ago" + (f" ({' '.join(who)})" if who else "")


def pulse(events: dict[str, asyncio.Event], name: str) -> None:
    """Wake everyone waiting on `name` and arm a fresh event for the next waiters.

    A waiter takes the current event BEFORE it looks at the state, so a change between its look and
    its wait still wakes it (the event it holds is already set)."""
    event = events.get(name)
    events[name] = asyncio.Event()
    if event is not None:
        event.set()


class CoordinatorState:
    """The service's state and the helpers its handlers share (`Coordinator` adds the handlers)."""

    def __init__(self, config: CoordinatorConfig, store: CoordinatorStore, state: LoadedState) -> None:
        self.config = config
        self.store = store
        self.started = time.time()
        self.agents = list(config.agents)
        self.versions: dict[str, tuple[int, float]] = dict(state.versions)
        self.heartbeats: dict[str, tuple[float, int | None, str | None]] = dict(state.heartbeats)
        self.ended: set[str] = set(state.ended)
        self.producers: dict[str, set[str]] = {k: set(v) for k, v in state.producers.items()}
        self._dirty_beats: dict[str, tuple[float, int | None, str | None]] = {}
        self._queue_events: dict[str, asyncio.Event] = {}
        self._version_events: dict[str, asyncio.Event] = {}
        self._waits: dict[str, int] = {"version": 0, "lease": 0}
        self.metrics = Metrics()
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mrlx-coord-cpu")
        self._buffers = BufferPool(keep=4)
        self._flusher: asyncio.Task[None] | None = None
        # What checks requests and proves answers (with a token; none: requests are not signed).
        self.signing = RequestSigning(config.token, config.metrics_token, self.started, self._cpu)

    def _check_run(self, run: str) -> None:
        if run != self.config.run_id:
            raise HttpProblem(404, f"this coordinator serves run {self.config.run_id!r}, not {run!r}")

    def _known_agent(self, name: str, what: str) -> str:
        if name not in self.agents:
            raise HttpProblem(
                404,
                f"unknown {what} {name!r}; the agents of run {self.config.run_id!r} are "
                f"{', '.join(self.agents)}",
            )
        return name

    def _record_identity(self, request: web.Request) -> None:
        agent = request.headers.get(AGENT_HEADER)
        if agent is None:
            return
        if agent not in self.agents:
            raise HttpProblem(
                422,
                f"header {AGENT_HEADER} names unknown agent {agent!r}; the agents are "
                f"{', '.join(self.agents)}",
            )
        pid_text = request.headers.get(PID_HEADER)
        pid = None
        if pid_text is not None:
            if not (pid_text.isascii() and pid_text.isdigit() and len(pid_text) <= 10):
                raise HttpProblem(422, f"header {PID_HEADER} must be a process id, got {pid_text!r}")
            pid = int(pid_text)
        host = request.headers.get(HOST_HEADER)
        if host:
            # Header bytes that are not UTF-8 arrive as surrogates; keep the name printable and storable.
            host = host.encode("utf-8", "surrogateescape").decode("utf-8", "replace")[:256]
        self._beat(agent, pid, host or None)

    def _beat(self, agent: str, pid: int | None, host: str | None) -> None:
        previous = self.heartbeats.get(agent)
        if previous is not None:
            pid = pid if pid is not None else previous[1]
            host = host if host is not None else previous[2]
        beat = (time.time(), pid, host)
        self.heartbeats[agent] = beat
        self._dirty_beats[agent] = beat

    async def _flush_heartbeats(self) -> None:
        if not self._dirty_beats:
            return
        beats, self._dirty_beats = self._dirty_beats, {}
        try:
            await self.store.save_heartbeats(beats)
        except StoreError as exc:
            log.warning("heartbeats not saved: %s", exc.message)
            for agent, beat in beats.items():
                self._dirty_beats.setdefault(agent, beat)

    async def _flush_heartbeats_forever(self) -> None:
        """Heartbeats live in memory and reach the file every few seconds: a per-call fsync would
        cost more than losing the last seconds of last-seen times in a crash."""
        while True:
            await asyncio.sleep(HEARTBEAT_FLUSH_S)
            await self._flush_heartbeats()

    async def _read_json(self, request: web.Request, model: type[B]) -> B:
        raw = await request.read()
        await self.signing.check_content(request, raw)
        return parse_body(raw, model, f"{request.method} {request.path}")

    @staticmethod
    def _json(data: object, status: int = 200) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")

    def _wait_started(self, kind: str) -> None:
        self._waits[kind] += 1

    def _wait_ended(self, kind: str, timed_out: bool) -> None:
        self._waits[kind] -= 1
        if timed_out:
            self.metrics.inc("mrlx_coordinator_wait_timeouts_total", kind=kind)
