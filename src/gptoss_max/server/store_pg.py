"""The response store in PostgreSQL, shared by every replica that is given the same URL.

psycopg 3; a few connections reused across the threads the routes call in (a connection
that broke, e.g. over a database restart, is dropped and the call retried once on a new
one). Rows are written whole (`INSERT ... ON CONFLICT DO UPDATE`), so replicas need no
coordination beyond the database's. The schema version lives in `gptoss_schema`; replicas
starting together migrate one at a time under an advisory lock.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from gptoss_max.server.store import (
    ROW_COLUMNS,
    SCHEMA_VERSION,
    VISIBLE_BEFORE,
    ResponseStore,
    SchemaTooNew,
    StoredResponse,
    chain_sql,
    delete_in,
    from_chain,
)

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS gptoss_responses (
            id TEXT PRIMARY KEY,
            created_at DOUBLE PRECISION NOT NULL,
            response TEXT NOT NULL,
            history TEXT NOT NULL,
            calls TEXT NOT NULL
        )""",
    ),
    ("ALTER TABLE gptoss_responses ADD COLUMN IF NOT EXISTS input_items TEXT NOT NULL DEFAULT '[]'",),
    (
        "ALTER TABLE gptoss_responses ADD COLUMN IF NOT EXISTS parent_id TEXT",
        "ALTER TABLE gptoss_responses ADD COLUMN IF NOT EXISTS hidden INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX IF NOT EXISTS gptoss_responses_parent ON gptoss_responses (parent_id)",
    ),
)
assert len(MIGRATIONS) == SCHEMA_VERSION, "both backends share version numbers"

_LOCK_ID = 0x6770746F73735F31  # pg_advisory_xact_lock key for migrations ("gptoss_1")
T = TypeVar("T")


def describe(dsn: str) -> str:
    """The URL without its password, for logs."""
    info = conninfo_to_dict(dsn)
    user = f"{info['user']}@" if info.get("user") else ""
    port = f":{info['port']}" if info.get("port") else ""
    return f"postgresql://{user}{info.get('host', '')}{port}/{info.get('dbname', '')}"


class PostgresStore(ResponseStore):
    def __init__(self, dsn: str, *, pool_size: int = 8, connect_timeout: int = 10):
        self._dsn = dsn
        self._timeout = connect_timeout
        self.location = describe(dsn)
        self._idle: queue.LifoQueue[psycopg.Connection] = queue.LifoQueue()
        self._pool_size = pool_size
        self._closed = False
        self._migrate()

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self._dsn, autocommit=True, connect_timeout=self._timeout)

    @contextlib.contextmanager
    def _conn(self) -> Iterator[psycopg.Connection]:
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = self._connect()
        try:
            yield conn
        except BaseException:
            conn.close()  # its state is unknown; the next call gets a fresh one
            raise
        if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.close()
        elif self._closed or self._idle.qsize() >= self._pool_size:
            conn.close()
        else:
            self._idle.put(conn)

    def _run(self, fn: Callable[[psycopg.Connection], T]) -> T:
        try:
            with self._conn() as conn:
                return fn(conn)
        except psycopg.OperationalError:  # a dropped connection: once more on a new one
            with self._conn() as conn:
                return fn(conn)

    def _migrate(self) -> None:
        def migrate(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
                conn.execute("CREATE TABLE IF NOT EXISTS gptoss_schema (version INTEGER NOT NULL)")
                row = conn.execute("SELECT version FROM gptoss_schema").fetchone()
                version = row[0] if row else 0
                if version > SCHEMA_VERSION:
                    raise SchemaTooNew(version, self.location)
                for statements in MIGRATIONS[version:]:
                    for sql in statements:
                        conn.execute(sql)
                if row is None:
                    conn.execute("INSERT INTO gptoss_schema VALUES (%s)", (SCHEMA_VERSION,))
                else:
                    conn.execute("UPDATE gptoss_schema SET version = %s", (SCHEMA_VERSION,))

        self._run(migrate)

    def schema_version(self) -> int:
        row = self._run(lambda c: c.execute("SELECT version FROM gptoss_schema").fetchone())
        return int(row[0]) if row else 0

    def _write(self, row: Callable[[bool], tuple], parent_id: str | None) -> None:
        sql = (
            f"INSERT INTO gptoss_responses ({ROW_COLUMNS}) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
            "created_at = EXCLUDED.created_at, response = EXCLUDED.response, "
            "history = EXCLUDED.history, calls = EXCLUDED.calls, input_items = EXCLUDED.input_items, "
            "parent_id = EXCLUDED.parent_id, hidden = EXCLUDED.hidden"
        )
        # FOR SHARE holds the parent's row until the child is in, so a delete of it sees the child
        held = "SELECT 1 FROM gptoss_responses WHERE id = %s FOR SHARE"

        def write(conn: psycopg.Connection) -> None:
            with conn.transaction():
                kept = parent_id is not None and conn.execute(held, (parent_id,)).fetchone() is not None
                conn.execute(sql, row(kept))

        self._run(write)

    def _visible_before(self, before: float, limit: int) -> list[str]:
        sql = VISIBLE_BEFORE.format("gptoss_responses")
        return [r[0] for r in self._run(lambda c: c.execute(sql, (before, limit)).fetchall())]

    def get(self, response_id: str) -> StoredResponse | None:
        sql = chain_sql("gptoss_responses", "%s")
        rows: Any = self._run(lambda c: c.execute(sql, (response_id,)).fetchall())
        return from_chain(rows, f"{self.location}: {response_id}")

    def delete(self, response_id: str) -> bool:
        def delete(conn: psycopg.Connection) -> bool:
            with conn.transaction():
                return delete_in(lambda q, a: _rows(conn.execute(q, a)), "gptoss_responses", response_id, " FOR UPDATE")

        return self._run(delete)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def _rows(cur: psycopg.Cursor) -> list:
    """A statement's rows; [] for one that returns none (UPDATE, DELETE)."""
    return cur.fetchall() if cur.description is not None else []
