"""The queue routes of the coordinator service: commits in (a wire frame, checked on a worker
thread), leases out (stored records streamed as they are), acks, step watermarks, releases,
rejections, extensions, seals and ends."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping

from aiohttp import web

from mrlx_plugin.coordinator.access import NONCE_KEY
from mrlx_plugin.coordinator.bodies import (
    AckBody,
    AckThroughBody,
    EndBody,
    ExtendBody,
    HttpProblem,
    LeaseBody,
    RejectBody,
    ReleaseBody,
    SealBody,
)
from mrlx_plugin.coordinator.config import (
    HASH_ON_THREAD_BYTES,
    MAX_COMMIT_ITEMS,
    MAX_FRAME_BATCHES,
    MAX_FRAME_MESSAGE_BYTES,
)
from mrlx_plugin.coordinator.state import AGENT_HEADER, CoordinatorState, pulse, seen_phrase
from mrlx_plugin.coordinator.storage import DeadGroup, LeaseGrant, QueueStats
from mrlx_plugin.core.netutil import BodyLengthError, read_declared
from mrlx_plugin.link.item_checks import validate_frame
from mrlx_plugin.link.wire import (
    CONTENT_TYPE,
    END_OF_STREAM,
    DeadLetter,
    FrameLimits,
    FrameTooLarge,
    FrameView,
    WireError,
    encode_frame,
    frame_head,
    scan_frame,
)

log = logging.getLogger("mrlx.coordinator")
LEASE_HEADER = "X-Mrlx-Lease-Id"


def _sha256_of(pieces: list[bytes]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


class QueueHandlers(CoordinatorState):
    """The handlers of the queue routes (`/v1/runs/{run}/queues/{consumer}/...`)."""

    async def _read_body(self, request: web.Request) -> tuple[memoryview, bytearray | None]:
        """The request body (give the buffer back after): into a reused buffer when one of its
        Content-Length is at hand, else into one grown as the bytes arrive. Memory follows the bytes
        received, never the length a client declares (which costs it nothing to send)."""
        length = request.content_length
        if length is None:
            return memoryview(await request.read()), None
        kept = self._buffers.take_existing(length)
        buf = bytearray() if kept is None else kept
        try:
            return await read_declared(request.content, length, buf), buf
        except BaseException as exc:
            self._buffers.give(buf)
            if not isinstance(exc, BodyLengthError):
                raise
            if exc.received < length:
                raise HttpProblem(
                    400, f"the request body ended after {exc.received} of its {length} bytes"
                ) from None
            raise HttpProblem(400, f"the request body is longer than its Content-Length {length}") from None

    def _scan(self, body: memoryview, consumer: str) -> FrameView:
        """Read and check a commit's frame, and cut it into the records the store keeps (on a
        worker thread: the arrays are checked and copied here, not on the event loop). The frame's
        limits are checked as its messages are read, so that memory follows the bytes accepted."""
        limits = FrameLimits(
            max_message_bytes=MAX_FRAME_MESSAGE_BYTES,
            max_batches=MAX_FRAME_BATCHES,
            max_items=MAX_COMMIT_ITEMS,
        )
        frame = scan_frame(body, limits)
        for record in frame.records:
            producer = record.meta["producer"]
            if producer not in self.agents:
                raise WireError(
                    f"item {record.meta['key']!r}: producer {producer!r} is not an agent of run "
                    f"{self.config.run_id!r} ({', '.join(self.agents)})"
                )
        validate_frame(frame)
        for record in frame.records:
            record.record()  # the copy SQLite stores; the body's buffer is reused after the commit
        return frame

    async def commit(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body, buf = await self._read_body(request)
        reusable = True
        try:
            await self.signing.check_content(request, body)
            try:
                frame = await asyncio.get_running_loop().run_in_executor(
                    self._cpu, self._scan, body, consumer
                )
            except FrameTooLarge as exc:
                raise HttpProblem(413, f"commit to {consumer!r} rejected, nothing written: {exc}") from None
            except WireError as exc:
                raise HttpProblem(422, f"commit to {consumer!r} rejected, nothing written: {exc}") from None
            outcome = await self.store.commit(consumer, frame.records, time.time(), self.config.max_depth)
        except asyncio.CancelledError:
            reusable = False  # a worker thread may still be reading the buffer
            raise
        finally:
            if buf is not None and reusable:  # SQLite copied what it keeps
                self._buffers.give(buf)
        if outcome.accepted:
            self.metrics.inc("mrlx_coordinator_items_enqueued_total", outcome.accepted, consumer=consumer)
            producers = self.producers.setdefault(consumer, set())
            producers.update(record.meta["producer"] for record in frame.records)
            pulse(self._queue_events, consumer)
        if outcome.duplicates:
            self.metrics.inc(
                "mrlx_coordinator_items_duplicate_total", len(outcome.duplicates), consumer=consumer
            )
        return self._json(
            {
                "accepted": outcome.accepted,
                "duplicates": len(outcome.duplicates),
                "duplicate_keys": outcome.duplicates,
                # items of steps the consumer acknowledged through: kept by key, never delivered
                **({"stale": outcome.stale} if outcome.stale else {}),
            }
        )

    async def lease(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, LeaseBody)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.wait_s
        waiting = False
        try:
            while True:
                event = self._queue_events.setdefault(consumer, asyncio.Event())
                if request.transport is None or request.transport.is_closing():
                    # The consumer gave up waiting; leasing now would only park groups until expiry.
                    return self._frame_response(
                        {"lease_id": None, "end": False, "groups": [], "message": "client gone"}
                    )
                grant = await self.store.lease(
                    consumer,
                    body.max_groups,
                    body.lease_s,
                    body.step,
                    time.time(),
                    self.config.max_deliveries,
                )
                self._count_dead(consumer, grant.dead, "deliveries")
                if grant.groups:
                    return await self._lease_response(consumer, grant, request)
                if grant.end or grant.dead:
                    return self._frame_response(
                        {
                            "lease_id": None,
                            "end": grant.end,
                            "groups": [],
                            "message": None,
                            "dead": self._dead_json(grant),
                        }
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    message = await self._no_groups_message(consumer, body.wait_s)
                    if waiting:
                        self._wait_ended("lease", True)
                        waiting = False
                    return self._frame_response(
                        {
                            "lease_id": None,
                            "end": False,
                            "groups": [],
                            "message": message,
                            "dead": self._dead_json(grant),
                        }
                    )
                timeout = remaining
                if grant.next_expiry is not None:  # another lease may expire first: look again then
                    timeout = min(timeout, max(0.01, grant.next_expiry - time.time() + 0.01))
                if not waiting:
                    self._wait_started("lease")
                    waiting = True
                try:
                    await asyncio.wait_for(event.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            if waiting:
                self._wait_ended("lease", False)

    async def _lease_response(
        self, consumer: str, grant: LeaseGrant, request: web.Request
    ) -> web.StreamResponse:
        records = await self.store.read_groups(consumer, [g.group for g in grant.groups])
        groups = []
        flat: list[bytes] = []
        redelivered = 0
        for granted, group_records in zip(grant.groups, records):
            groups.append(
                {
                    "group": granted.group,
                    "size": len(group_records),
                    "step": granted.step,
                    "producer": granted.producer,
                    "redelivered": granted.redelivered,
                }
            )
            flat.extend(group_records)
            if granted.redelivered:
                redelivered += len(group_records)
        header = {
            "lease_id": grant.lease_id,
            "end": False,
            "groups": groups,
            "message": None,
            "dead": self._dead_json(grant),
        }
        head = frame_head(header)
        self.metrics.inc("mrlx_coordinator_items_leased_total", len(flat), consumer=consumer)
        if redelivered:
            self.metrics.inc("mrlx_coordinator_items_redelivered_total", redelivered, consumer=consumer)
        # The stored records go out as they are, one write each: no frame is assembled in memory.
        response = web.StreamResponse(headers={LEASE_HEADER: grant.lease_id, "Content-Type": CONTENT_TYPE})
        response.content_length = len(head) + sum(len(record) for record in flat) + len(END_OF_STREAM)
        if request.get(NONCE_KEY) is not None:  # the proof covers the body: hashed before it is sent
            pieces = [head, *flat, END_OF_STREAM]
            if response.content_length > HASH_ON_THREAD_BYTES:
                content = await asyncio.get_running_loop().run_in_executor(self._cpu, _sha256_of, pieces)
            else:
                content = _sha256_of(pieces)
            self.signing.prove(request, response, content)
        try:
            await response.prepare(request)
            await response.write(head)
            for record in flat:
                await response.write(record)
            await response.write(END_OF_STREAM)
            await response.write_eof()
        except ConnectionError:
            # The consumer went away; its lease expires and the groups are delivered again.
            log.info("lease %s of %r: the consumer disconnected during the answer", grant.lease_id, consumer)
        return response

    @staticmethod
    def _dead_json(grant: LeaseGrant) -> list[DeadLetter]:
        """The groups set aside that a lease answer reports: those of the step asked for (every one,
        so that a consumer restarted after an earlier report learns them too), else this attempt's."""
        seen: dict[str, DeadGroup] = {}
        for dead in [*grant.step_dead, *grant.dead]:
            seen.setdefault(dead.group, dead)
        return [
            {"group": d.group, "size": d.n_items, "step": d.step, "producer": d.producer, "reason": d.reason}
            for d in seen.values()
        ]

    def _count_dead(self, consumer: str, dead: list[DeadGroup], reason: str) -> None:
        if not dead:
            return
        items = sum(d.n_items for d in dead)
        self.metrics.inc(
            "mrlx_coordinator_items_dead_lettered_total", items, consumer=consumer, reason=reason
        )
        for d in dead:
            log.warning(
                "group %r of step %s (%d items) for %r set aside, never delivered again: %s",
                d.group,
                d.step,
                d.n_items,
                consumer,
                d.reason,
            )
        pulse(self._queue_events, consumer)  # room for blocked producers

    def _frame_response(self, header: Mapping[str, object]) -> web.Response:
        return web.Response(body=encode_frame([], header), content_type=CONTENT_TYPE)

    async def _no_groups_message(self, consumer: str, waited: float) -> str:
        stats = (await self.store.queue_stats(time.time())).get(consumer, QueueStats())
        now = time.time()
        producers = sorted(
            self.producers.get(consumer) or [a for a in self.agents if a != consumer] or self.agents
        )
        seen = "; ".join(f"{p!r} {seen_phrase(self.heartbeats.get(p), now)}" for p in producers)
        return (
            f"no complete group for {consumer!r} within {waited:.1f} s "
            f"({stats.queued_items} items queued, {stats.incomplete_groups} incomplete groups, "
            f"{stats.leased_items} items leased); producers: {seen}"
        )

    def _count_acked(self, consumer: str, items: int) -> None:
        """Items done for good: counted, and room for blocked producers (maybe end-of-stream now)."""
        if items:
            self.metrics.inc("mrlx_coordinator_items_acked_total", items, consumer=consumer)
            pulse(self._queue_events, consumer)

    async def ack(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, AckBody)
        outcome = await self.store.ack(consumer, body.lease_id, time.time())
        self._count_acked(consumer, outcome.items)
        return self._json(
            {
                "acked_groups": outcome.groups,
                "acked_items": outcome.items,
                "already_acked": outcome.already_acked,
            }
        )

    async def ack_through(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, AckThroughBody)
        outcome = await self.store.ack_through(consumer, body.step, time.time())
        self._count_acked(consumer, outcome.items)
        return self._json(
            {
                "through_step": outcome.through_step,
                "acked_groups": outcome.groups,
                "acked_items": outcome.items,
            }
        )

    async def release(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        await self._read_json(request, ReleaseBody)
        released = await self.store.release(consumer, time.time())
        if released:
            log.info(
                "%d leased groups of %r handed back by its consumer (a restarted process)", released, consumer
            )
            pulse(self._queue_events, consumer)
        return self._json({"released_groups": released})

    async def reject(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, RejectBody)
        dead, already = await self.store.reject(consumer, body.group, body.reason, time.time())
        if not already:
            self._count_dead(consumer, [dead], "rejected")
        return self._json({"group": dead.group, "items": dead.n_items, "step": dead.step, "already": already})

    async def extend(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, ExtendBody)
        groups, expires = await self.store.extend(consumer, body.lease_id, body.lease_s, time.time())
        return self._json(
            {"lease_id": body.lease_id, "groups": groups, "expires_in_s": round(expires - time.time(), 3)}
        )

    async def seal(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, SealBody)
        complete = await self.store.seal(consumer, body.group, body.size)
        if complete:
            pulse(self._queue_events, consumer)
        return self._json({"group": body.group, "size": body.size, "complete": complete})

    async def end(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        await self._read_json(request, EndBody)
        sealed = await self.store.end(consumer, request.headers.get(AGENT_HEADER), time.time())
        self.ended.add(consumer)
        pulse(self._queue_events, consumer)
        return self._json({"ended": True, "sealed_groups": sealed})

    async def queue_info(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        stats = (await self.store.queue_stats(time.time())).get(consumer, QueueStats())
        return self._json(self._queue_json(consumer, stats))

    def _queue_json(self, consumer: str, stats: QueueStats) -> dict[str, object]:
        now = time.time()
        return {
            "consumer": consumer,
            "queued_items": stats.queued_items,
            "leased_items": stats.leased_items,
            "ready_groups": stats.ready_groups,
            "incomplete_groups": stats.incomplete_groups,
            "oldest_item_age_s": None
            if stats.oldest_created is None
            else round(now - stats.oldest_created, 3),
            "ended": consumer in self.ended,
            "max_depth": self.config.max_depth,
            "dead_groups": stats.dead_groups,
            "dead_items": stats.dead_items,
            "acked_through": self.store.watermark(consumer),
        }
