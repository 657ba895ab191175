"""What one commit writes, worked out step by step inside its transaction: the items new by key,
those of steps the consumer acknowledged through set apart, the queue's room checked, and the rows
of items, records and groups (each group refused when it would pass its size). `CoordinatorStore`
runs the steps in order (`_commit_sync`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from mrlx_plugin.coordinator.database import QueueFull, Rejected
from mrlx_plugin.link.wire import RecordView

_ITEM_COLUMNS = "seq, key, consumer, grp, producer, step, n_tokens, created"
# A row of `items` (`_ITEM_COLUMNS`), of `groups` as a commit starts one, and as it adds to one.
ItemRow = tuple[int, str, str, str, str, int, int, float]
NewGroupRow = tuple[str, str, str, int, int, int, int, int, float]
GrownGroupRow = tuple[int, int, str, str]


@dataclass
class CommitRows:
    """The rows one commit writes: its items and their records, the groups it starts and the
    groups it adds to; how many groups it completes, and the next item number after its own."""

    next_seq: int
    items: list[ItemRow] = field(default_factory=list)
    records: list[tuple[int, pa.Buffer]] = field(default_factory=list)
    new_groups: list[NewGroupRow] = field(default_factory=list)
    grown_groups: list[GrownGroupRow] = field(default_factory=list)
    completed: int = 0

    def write(self, conn: sqlite3.Connection) -> None:
        conn.executemany(f"INSERT INTO items ({_ITEM_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self.items)
        conn.executemany("INSERT INTO records (seq, record) VALUES (?, ?)", self.records)
        conn.executemany(
            "INSERT INTO groups (consumer, grp, producer, step, group_size, n_items, complete, "
            "first_seq, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            self.new_groups,
        )
        conn.executemany(
            "UPDATE groups SET n_items = ?, complete = ? WHERE consumer = ? AND grp = ?", self.grown_groups
        )


def _item_row(seq: int, record: RecordView, consumer: str, now: float) -> ItemRow:
    """An item's row of `items` (the columns `_ITEM_COLUMNS`)."""
    meta = record.meta
    return (seq, meta["key"], consumer, meta["group"], meta["producer"], meta["step"], meta["n_tokens"], now)


def new_by_key(
    conn: sqlite3.Connection, consumer: str, records: Sequence[RecordView]
) -> tuple[list[RecordView], list[str]]:
    """The records whose keys the queue has not seen (the first of a key repeated in the request),
    and the keys of the others (duplicates: no-ops); a key of another queue is refused (409)."""
    duplicates: list[str] = []
    fresh: list[RecordView] = []
    seen: set[str] = set()
    for record in records:
        key = record.meta["key"]
        if key in seen:
            duplicates.append(key)
            continue
        seen.add(key)
        row = conn.execute("SELECT consumer FROM items WHERE key = ?", (key,)).fetchone()
        if row is None:
            fresh.append(record)
        elif row[0] == consumer:
            duplicates.append(key)
        else:
            raise Rejected(
                f"item {key!r}: this key was already committed to the queue of {row[0]!r}; "
                "keys are unique per run (episode id + agent)",
                409,
            )
    return fresh, duplicates


def split_stale(fresh: list[RecordView], mark: int | None) -> tuple[list[RecordView], list[RecordView]]:
    """`fresh` less the items of steps up to `mark` (the step the consumer acknowledged through),
    and those items."""
    if mark is None:
        return fresh, []
    return [r for r in fresh if r.meta["step"] > mark], [r for r in fresh if r.meta["step"] <= mark]


def insert_stale(
    conn: sqlite3.Connection, consumer: str, stale: Sequence[RecordView], now: float, seq: int
) -> int:
    """Remember the keys of items of already-acknowledged steps, as acked items with no record,
    numbered from `seq`; returns the next number."""
    rows = [(*_item_row(seq + i, record, consumer, now), now) for i, record in enumerate(stale)]
    conn.executemany(f"INSERT INTO items ({_ITEM_COLUMNS}, acked) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return seq + len(rows)


def check_room(consumer: str, fresh: list[RecordView], max_depth: int, depth: int, ended: bool) -> None:
    """Refuse new items for an ended queue (409), more than the queue holds at all (413), or more
    than it has room for now beside its `depth` unacked items (429: its consumer acks first)."""
    if ended:
        raise Rejected(
            f"the queue of {consumer!r} was ended by its producer; no new items are accepted "
            f"(first new item {fresh[0].meta['key']!r})",
            409,
        )
    if len(fresh) > max_depth:
        raise Rejected(
            f"this request holds {len(fresh)} new items but the queue of {consumer!r} holds at "
            "most "
            f"{max_depth}; commit in smaller batches (or start the coordinator with a larger "
            "--max-depth)",
            413,
        )
    if depth + len(fresh) > max_depth:
        raise QueueFull(
            f"the queue of {consumer!r} holds {depth} unacked items; {len(fresh)} more would "
            "pass "
            f"its maximum depth {max_depth}; retry after the consumer acks"
        )


def queue_rows(
    conn: sqlite3.Connection, consumer: str, fresh: list[RecordView], now: float, seq: int
) -> CommitRows:
    """The rows that queue `fresh`, group by group, its items numbered from `seq`."""
    by_group: dict[str, list[RecordView]] = {}
    for record in fresh:
        by_group.setdefault(record.meta["group"], []).append(record)
    rows = CommitRows(seq)
    for group, members in by_group.items():
        _add_group(conn, consumer, group, members, now, rows)
    return rows


def _add_group(
    conn: sqlite3.Connection,
    consumer: str,
    group: str,
    members: list[RecordView],
    now: float,
    rows: CommitRows,
) -> None:
    """Add the rows of one group's new items to `rows`: the group is started, or grown within the
    size it was announced (or sealed) with."""
    first = members[0].meta
    size = first["group_size"]
    for record in members[1:]:
        if record.meta["group_size"] != size:
            raise Rejected(
                f"item {record.meta['key']!r}: group {group!r} announced group_size {size} "
                f"in this request and {record.meta['group_size']} here"
            )
    existing = conn.execute(
        "SELECT group_size, sealed_size, n_items, acked FROM groups WHERE consumer = ? AND grp = ?",
        (consumer, group),
    ).fetchone()
    if existing is None:
        limit, had, sealed = size, 0, None
    else:
        announced, sealed, had, _acked = existing
        if announced != size:
            raise Rejected(
                f"item {first['key']!r}: group {group!r} was announced with group_size "
                f"{announced}, "
                f"this item says {size}"
            )
        limit = sealed if sealed is not None else announced
    if had + len(members) > limit:
        what = f"sealed at {sealed}" if sealed is not None else f"of size {limit}"
        raise Rejected(
            f"item {members[0].meta['key']!r}: group {group!r} ({what}) already holds {had} "
            "items; "
            f"{len(members)} more would exceed it"
        )
    first_seq = rows.next_seq
    for record in members:
        rows.items.append(_item_row(rows.next_seq, record, consumer, now))
        rows.records.append((rows.next_seq, record.record()))
        rows.next_seq += 1
    n_items = had + len(members)
    complete = int(n_items >= limit)
    rows.completed += complete
    if existing is None:
        rows.new_groups.append(
            (consumer, group, first["producer"], first["step"], size, n_items, complete, first_seq, now)
        )
    else:
        rows.grown_groups.append((n_items, complete, consumer, group))
