"""Stored responses: the response object and the whole conversation behind it.

`history` is the Harmony conversation up to and including the response's own output
(JSON from `harmony.messages.to_json`), so `previous_response_id` continues it exactly;
`calls` maps every function call_id in it to the function's name. `input_items` are the
Responses items the response was generated from (earlier turns' inputs and outputs included,
each with an id), for `GET /v1/responses/{id}/input_items`.

A response that continues another (`previous_response_id`) is stored as what it adds: its row
names the parent and holds only the messages and items past the parent's, so a conversation of n
turns takes O(n) rows' worth of text, not O(n^2) (schema version 3). `get` joins the chain back.
Deleting a response that others continue hides it (its response object is dropped, the part of
the conversation its children need is kept) until its last child goes; rows written before
version 3 hold their whole conversation and have no parent.

Two backends behind one interface: SQLite (the default, one server) and PostgreSQL
(`store_pg.py`, shared by replicas behind a load balancer). Both keep the same versioned
schema: `MIGRATIONS[i]` takes a store from version i to i + 1; a store opened by this code
is brought up to `SCHEMA_VERSION`, and one written by a newer version is refused rather
than guessed at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gptoss_max import settings

logger = logging.getLogger("gptoss_max.server")

# SQLite's migrations. Version 1 is the table the first SQLite store created (without a version
# mark); a store without a mark but with this table is taken as version 1. PostgreSQL's own
# list (store_pg.py) has the same length and meaning.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS responses (
            id TEXT PRIMARY KEY,
            created_at REAL NOT NULL,
            response TEXT NOT NULL,
            history TEXT NOT NULL,
            calls TEXT NOT NULL
        )""",
    ),
    ("ALTER TABLE responses ADD COLUMN input_items TEXT NOT NULL DEFAULT '[]'",),  # 2: the input items
    (  # 3: rows that continue a parent hold what they add to it; hidden: deleted, kept for children
        "ALTER TABLE responses ADD COLUMN parent_id TEXT",
        "ALTER TABLE responses ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent_id)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


class SchemaTooNew(RuntimeError):
    """The store was written by a newer gptoss-max; this one does not know its schema."""

    def __init__(self, found: int, where: str):
        super().__init__(
            f"the response store at {where} has schema version {found}; this gptoss-max knows "
            f"versions up to {SCHEMA_VERSION}. Upgrade gptoss-max, or point --store elsewhere."
        )
        self.found = found


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    history: str
    calls: dict[str, str]
    input_items: list[dict] = field(default_factory=list)  # [] for rows stored before version 2


@dataclass(frozen=True)
class Parent:
    """The stored response a new one continues, and how many messages of the new one's history and
    items of its input items are the parent's (a prefix of each): the store keeps only the rest."""

    id: str
    messages: int
    items: int


class ResponseStore(ABC):
    """What the routes need from a store. Methods block; routes call them in a thread."""

    location: str  # where it is, for logs (never a password)

    def put(
        self,
        response: dict,
        history: str,
        calls: dict[str, str],
        input_items: list[dict],
        parent: Parent | None = None,
    ) -> None:
        """Store (or replace) `response` under its id, with its whole history and input items; with
        a parent that is still stored, only the part past the parent's is written (one deleted
        since it was read leaves this row whole)."""
        self._write(lambda kept: as_row(response, history, calls, input_items, parent if kept else None),
                    parent.id if parent else None)  # fmt: skip

    @abstractmethod
    def _write(self, row: Callable[[bool], tuple], parent_id: str | None) -> None:
        """In one transaction: whether `parent_id` (None: no parent) is stored, holding its row
        against a delete, then upsert `row(that)`, an `as_row` tuple."""

    @abstractmethod
    def get(self, response_id: str) -> StoredResponse | None:
        """The response with its whole history and input items (its chain of rows joined)."""

    @abstractmethod
    def delete(self, response_id: str) -> bool:
        """True if it existed (and was not already deleted)."""

    @abstractmethod
    def schema_version(self) -> int: ...

    def prune(self, before: float, batch: int = 500) -> int:
        """Delete every stored response created before `before` (Unix time), newest first, as
        `delete` does one (so one that a newer response continues stays, hidden, for it; its
        ancestors go when their last continuation does). Returns how many were deleted."""
        deleted = 0
        while ids := self._visible_before(before, batch):
            deleted += sum(self.delete(i) for i in ids)
        return deleted

    @abstractmethod
    def _visible_before(self, before: float, limit: int) -> list[str]:
        """Up to `limit` ids of responses not deleted and created before `before`, newest first."""

    def close(self) -> None:  # noqa: B027 - optional for a backend
        pass


# The columns `as_row` fills, in order.
ROW_COLUMNS = "id, created_at, response, history, calls, input_items, parent_id, hidden"


def as_row(
    response: dict, history: str, calls: dict[str, str], input_items: list[dict], parent: Parent | None
) -> tuple:
    """A row of the whole conversation (parent None), or of what it adds to a stored parent's."""
    parent_id = None
    if parent is not None:
        messages = json.loads(history)["messages"]  # harmony's Conversation JSON
        # not harmony's {"messages": ...}: a replica of version 2 reading it fails, not continues
        # the conversation without its earlier turns (docs/DEPLOY.md, schema versions)
        history = json.dumps({"added": messages[parent.messages :]})
        input_items, parent_id = input_items[parent.items :], parent.id
    return (
        response["id"], time.time(), json.dumps(response), history, json.dumps(calls), json.dumps(input_items),
        parent_id, 0,
    )  # fmt: skip


VISIBLE_BEFORE = "SELECT id FROM {} WHERE hidden = 0 AND created_at < %s ORDER BY created_at DESC LIMIT %s"


MAX_CHAIN = 100_000  # turns a chain is followed for: past it (or in a cycle) it reads as broken


def chain_sql(table: str, param: str) -> str:
    """The rows from a response up to its root, nearest first: (response, history, calls,
    input_items, parent_id, hidden). Both backends' SQL has WITH RECURSIVE."""
    cols = "response, history, calls, input_items, parent_id, hidden"
    return (
        f"WITH RECURSIVE chain (depth, {cols}) AS ("
        f"SELECT 0, {cols} FROM {table} WHERE id = {param} "
        f"UNION ALL SELECT c.depth + 1, {', '.join('r.' + c for c in cols.split(', '))} "
        f"FROM {table} r JOIN chain c ON r.id = c.parent_id WHERE c.depth < {MAX_CHAIN}"
        f") SELECT {cols} FROM chain ORDER BY depth"
    )


def from_chain(rows: list[tuple], where: str) -> StoredResponse | None:
    """Join a chain (nearest first, as `chain_sql` returns it) into one response; None if the
    response is not stored or deleted. A chain whose root is missing cannot be joined: None too
    (the store never leaves one, since a parent is kept while it has children); `where` names the
    store and the response for that log line."""
    if not rows or rows[0][5]:
        return None
    if rows[-1][4] is not None:
        logger.error("stored response chain of %s is broken at %s", where, rows[-1][4])
        return None
    response, history, calls = json.loads(rows[0][0]), rows[0][1], json.loads(rows[0][2])
    items: list[dict] = []
    for row in reversed(rows):
        items += json.loads(row[3])
    if len(rows) > 1:
        messages: list = []
        for row in reversed(rows):
            messages += json.loads(row[1])["messages" if row[4] is None else "added"]
        history = json.dumps({"messages": messages})
    return StoredResponse(response, history, calls, items)


def default_path() -> Path:
    return settings.data_dir() / "responses.sqlite3"


class SQLiteStore(ResponseStore):
    """One file (WAL), one connection shared by threads under a lock; the version in `user_version`."""

    def __init__(self, path: Path | str | None = None):
        path = default_path() if path is None else path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.location = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        if str(path) != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock, self._transaction():  # BEGIN IMMEDIATE: one process migrates at a time
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'responses'"
            ).fetchone():
                version = 1  # written before versions were marked
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(version, self.location)
            for statements in MIGRATIONS[version:]:
                for sql in statements:
                    self._db.execute(sql)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _write(self, row: Callable[[bool], tuple], parent_id: str | None) -> None:
        with self._lock, self._transaction():
            kept = parent_id is not None and bool(self._query("SELECT 1 FROM responses WHERE id = %s", (parent_id,)))
            sql = f"INSERT OR REPLACE INTO responses ({ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            self._db.execute(sql, row(kept))

    def _visible_before(self, before: float, limit: int) -> list[str]:
        with self._lock:
            return [r[0] for r in self._query(VISIBLE_BEFORE.format("responses"), (before, limit))]

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            rows = self._db.execute(chain_sql("responses", "?"), (response_id,)).fetchall()
        return from_chain(rows, f"{self.location}: {response_id}")

    def delete(self, response_id: str) -> bool:
        with self._lock, self._transaction():
            return delete_in(self._query, "responses", response_id)

    def _query(self, sql: str, args: tuple) -> list:
        return self._db.execute(sql.replace("%s", "?"), args).fetchall()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def delete_in(query: Callable[[str, tuple], list], table: str, response_id: str, lock: str = "") -> bool:
    """`delete` inside a backend's transaction (`query` runs one statement with `%s` parameters and
    returns its rows; `lock` ends the row reads, PostgreSQL's " FOR UPDATE"): a response that others
    continue is hidden, its response object dropped; one that none continues is removed, and so is
    each hidden ancestor that it leaves without children."""
    rows = query(f"SELECT parent_id, hidden FROM {table} WHERE id = %s{lock}", (response_id,))
    if not rows or rows[0][1]:
        return False
    target, parent = response_id, rows[0][0]
    while True:
        if query(f"SELECT 1 FROM {table} WHERE parent_id = %s LIMIT 1", (target,)):
            if target == response_id:
                query(f"UPDATE {table} SET hidden = 1, response = '{{}}', calls = '{{}}' WHERE id = %s", (target,))
            return True
        query(f"DELETE FROM {table} WHERE id = %s", (target,))
        if parent is None:
            return True
        up = query(f"SELECT parent_id, hidden FROM {table} WHERE id = %s{lock}", (parent,))
        if not up or not up[0][1]:
            return True
        target, parent = parent, up[0][0]


def is_postgres(spec: str) -> bool:
    return spec.startswith(("postgresql://", "postgres://"))


def open_store(spec: ResponseStore | Path | str | None = None) -> ResponseStore:
    """`--store`: a `postgresql://` URL, a SQLite file, or None (the data dir's SQLite file)."""
    if isinstance(spec, ResponseStore):
        return spec
    if isinstance(spec, str) and is_postgres(spec):
        from gptoss_max.server.store_pg import PostgresStore

        return PostgresStore(spec)
    return SQLiteStore(spec)
