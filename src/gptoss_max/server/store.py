"""Stored responses: the response object and the whole conversation behind it.

`history` is the Harmony conversation up to and including the response's own output
(JSON from `harmony.messages.to_json`), so `previous_response_id` continues it exactly;
`calls` maps every function call_id in it to the function's name. `input_items` are the
Responses items the response was generated from (earlier turns' inputs and outputs included,
each with an id), for `GET /v1/responses/{id}/input_items`.

Two backends behind one interface: SQLite (the default, one server) and PostgreSQL
(`store_pg.py`, shared by replicas behind a load balancer). Both keep the same versioned
schema: `MIGRATIONS[i]` takes a store from version i to i + 1; a store opened by this code
is brought up to `SCHEMA_VERSION`, and one written by a newer version is refused rather
than guessed at.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from gptoss_max import settings

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


class ResponseStore(ABC):
    """What the routes need from a store. Methods block; routes call them in a thread."""

    location: str  # where it is, for logs (never a password)

    @abstractmethod
    def put(self, response: dict, history: str, calls: dict[str, str], input_items: list[dict]) -> None:
        """Store (or replace) `response` under its id."""

    @abstractmethod
    def get(self, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    def delete(self, response_id: str) -> bool:
        """True if it existed."""

    @abstractmethod
    def schema_version(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional for a backend
        pass


# The columns `as_row` fills, in order, and those `from_row` reads.
ROW_COLUMNS = "id, created_at, response, history, calls, input_items"
READ_COLUMNS = "response, history, calls, input_items"


def as_row(response: dict, history: str, calls: dict[str, str], input_items: list[dict]) -> tuple:
    return (response["id"], time.time(), json.dumps(response), history, json.dumps(calls), json.dumps(input_items))


def from_row(row: tuple | None) -> StoredResponse | None:
    if row is None:
        return None
    return StoredResponse(json.loads(row[0]), row[1], json.loads(row[2]), json.loads(row[3]))


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
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # one process migrates at a time
            try:
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
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def put(self, response: dict, history: str, calls: dict[str, str], input_items: list[dict]) -> None:
        row = as_row(response, history, calls, input_items)
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO responses ({ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", row)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(f"SELECT {READ_COLUMNS} FROM responses WHERE id = ?", (response_id,)).fetchone()
        return from_row(row)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


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
