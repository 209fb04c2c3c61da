"""Stored responses in SQLite: the response object and the whole conversation behind it.

`history` is the Harmony conversation up to and including the response's own output
(JSON from `harmony.messages.to_json`), so `previous_response_id` continues it exactly;
`calls` maps every function call_id in it to the function's name.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gptoss_max import settings

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    history TEXT NOT NULL,
    calls TEXT NOT NULL
)
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    history: str
    calls: dict[str, str]


def default_path() -> Path:
    return settings.data_dir() / "responses.sqlite3"


class ResponseStore:
    def __init__(self, path: Path | str | None = None):
        path = default_path() if path is None else path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        if str(path) != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def put(self, response: dict, history: str, calls: dict[str, str]) -> None:
        row = (response["id"], time.time(), json.dumps(response), history, json.dumps(calls))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, history, calls FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), row[1], json.loads(row[2]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
