"""The coordinator's durable store: queues, leases, acks, weight versions, heartbeats and
end-of-stream marks in one SQLite file (`database` has the file, its threads and its transactions).

Layout: `items` holds one small row per item ever committed (its key stays forever, so a re-commit
of an acked key is recognised as a duplicate); `records` holds the item's wire record (a one-row Arrow
record batch message, see `wire`) until the item is acked, when it is deleted; `groups` is the
unit of delivery; `leases` remembers which groups each lease took. Lease expiry is wall-clock
time, so leased-but-unacked groups come back after their expiry across a restart too.

Delivery by step: `watermarks` holds, per consumer, the producer step through which the consumer has
acknowledged everything (`ack_through`: every group of that step or an earlier one is done, leased or
not; an item of such a step committed later is remembered by key and dropped, never delivered). A
group leased `max_deliveries` times without an ack, or rejected by its consumer, is set aside
(`groups.dead`, with its reason): kept in the file with its records, never delivered again, not
counted in the queue's depth.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from mrlx_plugin.coordinator.commits import check_room, insert_stale, new_by_key, queue_rows, split_stale
from mrlx_plugin.coordinator.database import Database, Rejected
from mrlx_plugin.link.wire import RecordView

# A group set aside (dead-lettered): by a lease past --max-deliveries, or by its consumer.
_SET_ASIDE = (
    "UPDATE groups SET dead = ?, dead_reason = ?, lease_expires = NULL WHERE consumer = ? AND grp = ?"
)


@dataclass
class CommitOutcome:
    accepted: int
    duplicates: list[str]
    completed_groups: int
    stale: int = 0  # new items of steps the consumer acked through: remembered by key, not queued


@dataclass
class GrantedGroup:
    group: str
    n_items: int
    step: int
    producer: str
    redelivered: bool


@dataclass
class DeadGroup:
    """A group set aside (dead-lettered): never delivered again, kept in the file."""

    group: str
    n_items: int
    step: int
    producer: str
    reason: str


@dataclass
class LeaseGrant:
    """The answer of one lease attempt: groups under a new lease, or none (and maybe end-of-stream)."""

    lease_id: str | None
    groups: list[GrantedGroup]
    end: bool
    next_expiry: float | None  # earliest expiry of another lease of this queue, to wake a waiter
    dead: list[DeadGroup] = field(default_factory=list)  # set aside by this attempt
    step_dead: list[DeadGroup] = field(default_factory=list)  # every group set aside of the step asked for


@dataclass
class AckThroughOutcome:
    through_step: int
    groups: int
    items: int


@dataclass
class AckOutcome:
    groups: int
    items: int
    already_acked: bool


@dataclass
class QueueStats:
    queued_items: int = 0
    leased_items: int = 0
    ready_groups: int = 0
    incomplete_groups: int = 0
    oldest_created: float | None = None
    dead_groups: int = 0
    dead_items: int = 0


@dataclass
class LoadedState:
    """What the server keeps in memory, as found in the file at start."""

    versions: dict[str, tuple[int, float]] = field(default_factory=dict)
    heartbeats: dict[str, tuple[float, int | None, str | None]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    producers: dict[str, set[str]] = field(default_factory=dict)
    unacked: dict[str, int] = field(default_factory=dict)
    watermarks: dict[str, int] = field(default_factory=dict)


class CoordinatorStore(Database):
    """The SQLite store; create with `await CoordinatorStore.open(...)`, end with `await close()`."""

    def __init__(
        self, path: str, run_id: str, *, synchronous: str = "full", max_db_mb: float | None = None
    ) -> None:
        super().__init__(path, run_id, synchronous=synchronous, max_db_mb=max_db_mb)
        self._next_seq = 1
        # Owned by the writer thread: unacked items per consumer (depth), ended queues.
        self._unacked: dict[str, int] = {}
        self._ended: set[str] = set()
        self._watermarks: dict[str, int] = {}  # consumer -> step acked through (read by any thread)

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    async def open(
        cls, path: str, run_id: str, *, synchronous: str = "full", max_db_mb: float | None = None
    ) -> tuple[CoordinatorStore, LoadedState]:
        """Open (or create) the file for `run_id` and load the state the server keeps in memory."""
        store = cls(path, run_id, synchronous=synchronous, max_db_mb=max_db_mb)
        state = await store._start(store._load_state_sync)
        return store, state

    def _load_state_sync(self) -> LoadedState:
        conn = self._writing()
        state = LoadedState()
        for agent, version, updated in conn.execute("SELECT agent, version, updated FROM versions"):
            state.versions[agent] = (version, updated)
        for agent, last_seen, pid, host in conn.execute("SELECT agent, last_seen, pid, host FROM agents"):
            state.heartbeats[agent] = (last_seen, pid, host)
        state.ended = {row[0] for row in conn.execute("SELECT consumer FROM ended")}
        for consumer, producer in conn.execute("SELECT DISTINCT consumer, producer FROM groups"):
            state.producers.setdefault(consumer, set()).add(producer)
        for consumer, count in conn.execute(
            "SELECT consumer, SUM(n_items) FROM groups WHERE acked IS NULL AND dead IS NULL GROUP BY consumer"
        ):
            state.unacked[consumer] = int(count or 0)
        state.watermarks = {c: int(s) for c, s in conn.execute("SELECT consumer, step FROM watermarks")}
        self._unacked = dict(state.unacked)
        self._ended = set(state.ended)
        self._watermarks = dict(state.watermarks)
        self._next_seq = (conn.execute("SELECT MAX(seq) FROM items").fetchone()[0] or 0) + 1
        return state

    def watermark(self, consumer: str) -> int | None:
        """The step `consumer` has acknowledged everything through (None: none yet)."""
        return self._watermarks.get(consumer)

    def _count_unacked(self, consumer: str, change: int) -> None:
        self._unacked[consumer] = self._unacked.get(consumer, 0) + change

    # ----------------------------------------------------------------- queues

    async def commit(
        self, consumer: str, records: Sequence[RecordView], now: float, max_depth: int
    ) -> CommitOutcome:
        """Store validated records for `consumer`, all or nothing (see `_commit_sync`)."""
        return await self._in_writer(self._commit_sync, consumer, records, now, max_depth)

    def _commit_sync(
        self, consumer: str, records: Sequence[RecordView], now: float, max_depth: int
    ) -> CommitOutcome:
        """One commit, one transaction (`commits` has its steps): the items new by key, less those
        of steps the consumer acknowledged through (kept by key, a re-commit is a duplicate; never
        queued: the consumer never asks for them again), queued if the queue has room for all of
        them and their groups take them."""
        conn = self._writing()
        with self._transaction():
            fresh, duplicates = new_by_key(conn, consumer, records)
            fresh, stale = split_stale(fresh, self._watermarks.get(consumer))
            seq = insert_stale(conn, consumer, stale, now, self._next_seq) if stale else self._next_seq
            if fresh:
                check_room(
                    consumer, fresh, max_depth, self._unacked.get(consumer, 0), consumer in self._ended
                )
                rows = queue_rows(conn, consumer, fresh, now, seq)
                rows.write(conn)
                seq = rows.next_seq
        self._next_seq = seq  # only once the transaction is in the file
        if not fresh:
            if stale:
                self._after_write()
            return CommitOutcome(0, duplicates, 0, len(stale))
        self._count_unacked(consumer, len(fresh))
        self._after_write()
        return CommitOutcome(len(fresh), duplicates, rows.completed, len(stale))

    async def seal(self, consumer: str, group: str, size: int) -> bool:
        """Fix the final size of a group that came up short; True when the group is now complete."""
        return await self._in_writer(self._seal_sync, consumer, group, size)

    def _seal_sync(self, consumer: str, group: str, size: int) -> bool:
        conn = self._writing()
        with self._transaction():
            announced, sealed, n_items, complete, acked = _group_of(
                conn,
                consumer,
                group,
                "group_size, sealed_size, n_items, complete, acked",
                "; seal a group after committing its items",
            )
            limit = sealed if sealed is not None else announced
            if size == limit:
                return bool(complete)
            if complete or acked is not None:
                raise Rejected(
                    f"group {group!r} is already complete with {limit} items; it cannot be sealed at {size}",
                    409,
                )
            if size > announced:
                raise Rejected(
                    f"group {group!r} was announced with {announced} items; it cannot be sealed at {size}"
                )
            if size < n_items:
                raise Rejected(
                    f"group {group!r} already holds {n_items} items; it cannot be sealed at {size}"
                )
            now_complete = int(n_items >= size)
            conn.execute(
                "UPDATE groups SET sealed_size = ?, complete = ? WHERE consumer = ? AND grp = ?",
                (size, now_complete, consumer, group),
            )
        self._after_write()
        return bool(now_complete)

    async def end(self, consumer: str, by_agent: str | None, now: float) -> int:
        """Mark the queue ended; every incomplete group is sealed at the items it has (returns how many)."""
        return await self._in_writer(self._end_sync, consumer, by_agent, now)

    def _end_sync(self, consumer: str, by_agent: str | None, now: float) -> int:
        conn = self._writing()
        with self._transaction():
            conn.execute(
                "INSERT OR IGNORE INTO ended (consumer, ended, by_agent) VALUES (?, ?, ?)",
                (consumer, now, by_agent),
            )
            sealed = conn.execute(
                "UPDATE groups SET sealed_size = n_items, complete = 1 "
                "WHERE consumer = ? AND complete = 0 AND acked IS NULL AND dead IS NULL",
                (consumer,),
            ).rowcount
        self._ended.add(consumer)
        self._after_write()
        return sealed

    async def lease(
        self,
        consumer: str,
        max_groups: int,
        lease_s: float,
        step: int | None,
        now: float,
        max_deliveries: int | None = None,
    ) -> LeaseGrant:
        """Lease up to `max_groups` complete groups, oldest first, until `now + lease_s`; a group
        already delivered `max_deliveries` times (and never acked) is set aside instead."""
        return await self._in_writer(
            self._lease_sync, consumer, max_groups, lease_s, step, now, max_deliveries
        )

    def _lease_sync(
        self,
        consumer: str,
        max_groups: int,
        lease_s: float,
        step: int | None,
        now: float,
        max_deliveries: int | None = None,
    ) -> LeaseGrant:
        conn = self._writing()
        query = (
            "SELECT grp, n_items, step, producer, deliveries FROM groups "
            "WHERE consumer = ? AND acked IS NULL AND dead IS NULL AND complete = 1 "
            "AND (lease_expires IS NULL OR lease_expires <= ?)"
        )
        params: list[str | float] = [consumer, now]
        if step is not None:
            query += " AND step = ?"
            params.append(step)
        query += " ORDER BY first_seq LIMIT ?"
        params.append(max_groups)
        dead: list[DeadGroup] = []
        with self._transaction():
            rows = conn.execute(query, params).fetchall()
            if max_deliveries is not None:
                rows, dead = _over_delivered(rows, max_deliveries)
                conn.executemany(_SET_ASIDE, [(now, d.reason, consumer, d.group) for d in dead])
            lease_id = None
            if rows:
                lease_id = secrets.token_hex(12)
                expires = now + lease_s
                conn.executemany(
                    "UPDATE groups SET lease_id = ?, lease_expires = ?, deliveries = deliveries + 1 "
                    "WHERE consumer = ? AND grp = ?",
                    [(lease_id, expires, consumer, row[0]) for row in rows],
                )
                conn.execute(
                    "INSERT INTO leases (lease_id, consumer, groups, created, expires) VALUES (?, ?, ?, ?, "
                    "?)",
                    (lease_id, consumer, orjson.dumps([row[0] for row in rows]).decode(), now, expires),
                )
        if dead:
            self._count_unacked(consumer, -sum(d.n_items for d in dead))
        if rows or dead:
            self._after_write()
        end = False
        if not rows and consumer in self._ended:
            end = (
                conn.execute(
                    "SELECT 1 FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL LIMIT 1",
                    (consumer,),
                ).fetchone()
                is None
            )
        next_expiry = conn.execute(
            "SELECT MIN(lease_expires) FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL "
            "AND lease_expires > ?",
            (consumer, now),
        ).fetchone()[0]
        step_dead = []
        if step is not None:
            step_dead = [
                DeadGroup(*row)
                for row in conn.execute(
                    "SELECT grp, n_items, step, producer, dead_reason FROM groups "
                    "WHERE consumer = ? AND dead IS NOT NULL AND step = ? ORDER BY first_seq",
                    (consumer, step),
                )
            ]
        groups = [GrantedGroup(row[0], row[1], row[2], row[3], row[4] > 0) for row in rows]
        return LeaseGrant(lease_id, groups, end, next_expiry, dead, step_dead)

    async def release(self, consumer: str, now: float) -> int:
        """Hand back every lease of `consumer` now (its new process takes over a dead one's leases:
        their groups are leasable at once, as after an expiry). Returns how many groups."""
        return await self._in_writer(self._release_sync, consumer, now)

    def _release_sync(self, consumer: str, now: float) -> int:
        conn = self._writing()
        with self._transaction():
            released = conn.execute(
                "UPDATE groups SET lease_expires = ? WHERE consumer = ? AND acked IS NULL AND dead IS NULL "
                "AND lease_expires > ?",
                (now, consumer, now),
            ).rowcount
            conn.execute(
                "UPDATE leases SET expires = ? WHERE consumer = ? AND acked IS NULL AND expires > ?",
                (now, consumer, now),
            )
        if released:
            self._after_write()
        return released

    async def reject(self, consumer: str, group: str, reason: str, now: float) -> tuple[DeadGroup, bool]:
        """Set a group aside now (its consumer cannot train it): (the group, whether it was already)."""
        return await self._in_writer(self._reject_sync, consumer, group, reason, now)

    def _reject_sync(self, consumer: str, group: str, reason: str, now: float) -> tuple[DeadGroup, bool]:
        conn = self._writing()
        with self._transaction():
            n_items, step, producer, acked, dead, old_reason = _group_of(
                conn, consumer, group, "n_items, step, producer, acked, dead, dead_reason"
            )
            if dead is not None:
                return DeadGroup(group, n_items, step, producer, old_reason), True
            if acked is not None:
                raise Rejected(
                    f"group {group!r} was acknowledged already; there is nothing left to set aside", 409
                )
            conn.execute(_SET_ASIDE, (now, reason, consumer, group))
        self._count_unacked(consumer, -n_items)
        self._after_write()
        return DeadGroup(group, n_items, step, producer, reason), False

    async def ack_through(self, consumer: str, step: int, now: float) -> AckThroughOutcome:
        """Mark every group of `consumer` of producer step <= `step` done for good (leased or not)
        and remember the step: idempotent, and a lower step than the one remembered changes nothing."""
        return await self._in_writer(self._ack_through_sync, consumer, step, now)

    def _ack_through_sync(self, consumer: str, step: int, now: float) -> AckThroughOutcome:
        conn = self._writing()
        mark = self._watermarks.get(consumer)
        if mark is not None and step <= mark:
            return AckThroughOutcome(mark, 0, 0)
        with self._transaction():
            rows = conn.execute(
                "SELECT grp, n_items FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL AND "
                "step <= ?",
                (consumer, step),
            ).fetchall()
            _mark_acked(conn, consumer, [g for g, _ in rows], now)
            conn.execute(
                "INSERT INTO watermarks (consumer, step, updated) VALUES (?, ?, ?) ON CONFLICT (consumer) "
                "DO UPDATE SET step = excluded.step, updated = excluded.updated WHERE excluded.step > "
                "watermarks.step",
                (consumer, step, now),
            )
        n_items = sum(n for _, n in rows)
        self._watermarks[consumer] = step
        self._count_unacked(consumer, -n_items)
        self._after_write()
        return AckThroughOutcome(step, len(rows), n_items)

    async def read_groups(self, consumer: str, groups: Sequence[str]) -> list[list[bytes]]:
        """The stored wire records of each group, in commit order (on a reader thread)."""
        return await self._in_reader(self._read_groups_sync, consumer, groups)

    def _read_groups_sync(self, consumer: str, groups: Sequence[str]) -> list[list[bytes]]:
        conn = self._reader()
        out = []
        conn.execute("BEGIN")  # one snapshot for all groups
        try:
            for group in groups:
                rows = conn.execute(
                    "SELECT r.record FROM items i JOIN records r ON r.seq = i.seq "
                    "WHERE i.consumer = ? AND i.grp = ? ORDER BY i.seq",
                    (consumer, group),
                ).fetchall()
                out.append([row[0] for row in rows])
        finally:
            conn.execute("COMMIT")
        return out

    async def ack(self, consumer: str, lease_id: str, now: float) -> AckOutcome:
        """Mark every group of a lease done for good and drop their records."""
        return await self._in_writer(self._ack_sync, consumer, lease_id, now)

    def _ack_sync(self, consumer: str, lease_id: str, now: float) -> AckOutcome:
        conn = self._writing()
        with self._transaction():
            groups, expires, acked = _lease_of(conn, consumer, lease_id)
            if acked is not None:
                return AckOutcome(0, 0, True)
            owned = []
            lost = 0
            for group in groups:
                state = conn.execute(
                    "SELECT n_items, lease_id, acked, dead FROM groups WHERE consumer = ? AND grp = ?",
                    (consumer, group),
                ).fetchone()
                if state is None or (state[1] != lease_id and state[2] is None and state[3] is None):
                    lost += 1  # open under another lease
                elif state[2] is None and state[3] is None:
                    owned.append((group, state[0]))
                # else: done already (acked through its step) or set aside: nothing left to do
            if lost:
                raise Rejected(
                    f"lease {lease_id!r} expired {now - expires:.1f} s ago and {lost} of its "
                    f"{len(groups)} groups were delivered again under another lease; nothing was acked "
                    "(ack the newer lease instead, or lease with a longer lease_s)",
                    409,
                )
            _mark_acked(conn, consumer, [g for g, _ in owned], now)
            conn.execute("UPDATE leases SET acked = ? WHERE lease_id = ?", (now, lease_id))
        n_items = sum(n for _, n in owned)
        self._count_unacked(consumer, -n_items)
        self._after_write()
        return AckOutcome(len(owned), n_items, not owned)

    async def extend(self, consumer: str, lease_id: str, lease_s: float, now: float) -> tuple[int, float]:
        """Keep a lease's groups until `now + lease_s` (a trainer still working on them); returns
        (groups, new expiry). Refused (409) once its groups went to another lease or were acked."""
        return await self._in_writer(self._extend_sync, consumer, lease_id, lease_s, now)

    def _extend_sync(self, consumer: str, lease_id: str, lease_s: float, now: float) -> tuple[int, float]:
        conn = self._writing()
        with self._transaction():
            groups, expires, acked = _lease_of(conn, consumer, lease_id)
            if acked is not None:
                raise Rejected(f"lease {lease_id!r} was acked already; there is nothing left to keep", 409)
            new_expiry = now + lease_s
            held = conn.execute(
                "UPDATE groups SET lease_expires = ? WHERE consumer = ? AND lease_id = ? AND acked IS NULL "
                "AND dead IS NULL",
                (new_expiry, consumer, lease_id),
            ).rowcount
            held += conn.execute(  # done through its step, or set aside: nothing to keep, nothing lost
                "SELECT COUNT(*) FROM groups WHERE consumer = ? AND lease_id = ? "
                "AND (acked IS NOT NULL OR dead IS NOT NULL)",
                (consumer, lease_id),
            ).fetchone()[0]
            if held != len(groups):
                raise Rejected(
                    f"lease {lease_id!r} expired {now - expires:.1f} s ago and {len(groups) - held} of its "
                    f"{len(groups)} groups were delivered again under another lease; it cannot be extended",
                    409,
                )
            conn.execute("UPDATE leases SET expires = ? WHERE lease_id = ?", (new_expiry, lease_id))
        self._after_write()
        return len(groups), new_expiry

    async def queue_stats(self, now: float) -> dict[str, QueueStats]:
        """Depth and age per consumer queue (on a reader thread)."""
        return await self._in_reader(self._queue_stats_sync, now)

    def _queue_stats_sync(self, now: float) -> dict[str, QueueStats]:
        conn = self._reader()
        stats: dict[str, QueueStats] = {}
        for consumer, leased, queued, ready, incomplete, oldest in conn.execute(
            "SELECT consumer, "
            "SUM(CASE WHEN lease_expires > :now THEN n_items ELSE 0 END), "
            "SUM(CASE WHEN lease_expires > :now THEN 0 ELSE n_items END), "
            "SUM(CASE WHEN complete = 1 AND (lease_expires IS NULL OR lease_expires <= :now) THEN 1 ELSE 0 "
            "END), "
            "SUM(CASE WHEN complete = 0 THEN 1 ELSE 0 END), "
            "MIN(created) "
            "FROM groups WHERE acked IS NULL AND dead IS NULL GROUP BY consumer",
            {"now": now},
        ):
            stats[consumer] = QueueStats(
                int(queued or 0), int(leased or 0), int(ready or 0), int(incomplete or 0), oldest
            )
        for consumer, groups, items in conn.execute(
            "SELECT consumer, COUNT(*), SUM(n_items) FROM groups WHERE dead IS NOT NULL GROUP BY consumer"
        ):
            entry = stats.setdefault(consumer, QueueStats())
            entry.dead_groups, entry.dead_items = int(groups), int(items or 0)
        return stats

    # ----------------------------------------------------------------- agents

    async def save_version(self, agent: str, version: int, now: float) -> None:
        """Persist an agent's weight version (a lower one than stored is ignored)."""
        await self._in_writer(self._save_version_sync, agent, version, now)

    def _save_version_sync(self, agent: str, version: int, now: float) -> None:
        conn = self._writing()
        with self._transaction():
            conn.execute(
                "INSERT INTO versions (agent, version, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (agent) DO UPDATE SET version = excluded.version, updated = excluded.updated "
                "WHERE excluded.version > versions.version",
                (agent, version, now),
            )
        self._after_write()

    async def save_heartbeats(self, beats: dict[str, tuple[float, int | None, str | None]]) -> None:
        """Persist the last-seen time and identity of agents."""
        await self._in_writer(self._save_heartbeats_sync, beats)

    def _save_heartbeats_sync(self, beats: dict[str, tuple[float, int | None, str | None]]) -> None:
        conn = self._writing()
        with self._transaction():
            conn.executemany(
                "INSERT INTO agents (agent, last_seen, pid, host) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (agent) DO UPDATE SET last_seen = excluded.last_seen, pid = excluded.pid, host "
                "= excluded.host",
                [(agent, seen, pid, host) for agent, (seen, pid, host) in beats.items()],
            )
        self._after_write()


# A leasable group's row: grp, n_items, step, producer, deliveries.
_LeasableRow = tuple[str, int, int, str, int]


def _over_delivered(
    rows: list[_LeasableRow], max_deliveries: int
) -> tuple[list[_LeasableRow], list[DeadGroup]]:
    """Leasable rows (grp, n_items, step, producer, deliveries) split into those to lease and the
    groups to set aside, delivered `max_deliveries` times already and never acknowledged."""
    dead = [
        DeadGroup(
            row[0],
            row[1],
            row[2],
            row[3],
            f"delivered {row[4]} times and never acknowledged (its consumer failed or died on it each "
            f"time; --max-deliveries {max_deliveries})",
        )
        for row in rows
        if row[4] >= max_deliveries
    ]
    return [row for row in rows if row[4] < max_deliveries], dead


def _group_of(conn: sqlite3.Connection, consumer: str, group: str, columns: str, hint: str = "") -> tuple:
    """The `columns` of a group of `consumer`'s queue; 404 (with `hint`) when it has no items there."""
    row = conn.execute(
        f"SELECT {columns} FROM groups WHERE consumer = ? AND grp = ?", (consumer, group)
    ).fetchone()
    if row is None:
        raise Rejected(f"group {group!r} has no items in the queue of {consumer!r}{hint}", 404)
    return row


def _mark_acked(conn: sqlite3.Connection, consumer: str, groups: list[str], now: float) -> None:
    """Mark `groups` of `consumer`'s queue done for good, with their items, and drop their records."""
    conn.executemany(
        "UPDATE groups SET acked = ? WHERE consumer = ? AND grp = ?", [(now, consumer, g) for g in groups]
    )
    conn.executemany(
        "DELETE FROM records WHERE seq IN (SELECT seq FROM items WHERE consumer = ? AND grp = ?)",
        [(consumer, g) for g in groups],
    )
    conn.executemany(
        "UPDATE items SET acked = ? WHERE consumer = ? AND grp = ? AND acked IS NULL",
        [(now, consumer, g) for g in groups],
    )


def _lease_of(
    conn: sqlite3.Connection, consumer: str, lease_id: str
) -> tuple[list[str], float, float | None]:
    """(groups, expiry, acked time) of a lease of `consumer`'s queue; 404 for any other id."""
    row = conn.execute(
        "SELECT consumer, groups, expires, acked FROM leases WHERE lease_id = ?", (lease_id,)
    ).fetchone()
    if row is None or row[0] != consumer:
        raise Rejected(f"unknown lease {lease_id!r} for the queue of {consumer!r}", 404)
    return orjson.loads(row[1]), row[2], row[3]
