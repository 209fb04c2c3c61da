"""The response store: SQLite and PostgreSQL (a real server, see pg_fixtures.py) behind one interface."""

import json
import sqlite3
import threading

import psycopg
import pytest

from gptoss_max.harmony import messages as hm
from gptoss_max.server.store import (
    SCHEMA_VERSION,
    SchemaTooNew,
    SQLiteStore,
    default_path,
    open_store,
)
from gptoss_max.server.store_pg import PostgresStore, describe
from pg_fixtures import pg_server_url, pg_url  # noqa: F401 - fixtures


@pytest.fixture(params=["sqlite", "postgresql"])
def spec(request, tmp_path):
    """What `--store` would be given, for each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "sub" / "r.sqlite3")
    return request.getfixturevalue("pg_url")


def test_put_get_delete_and_reopen(spec):
    history = hm.to_json([hm.user("hi"), hm.function_call("f", "{}")])
    store = open_store(spec)
    assert store.schema_version() == SCHEMA_VERSION
    store.put({"id": "resp_1", "output": []}, history, {"call_1": "f"}, [])
    items = [{"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    store.put({"id": "resp_1", "output": [1], "z": 1, "a": 2}, history, {"call_1": "f"}, items)  # replaces
    store.close()
    again = open_store(spec)
    got = again.get("resp_1")
    assert got.response == {"id": "resp_1", "output": [1], "z": 1, "a": 2} and got.calls == {"call_1": "f"}
    assert got.input_items == items
    assert list(got.response) == ["id", "output", "z", "a"], "stored as written"
    assert [m.recipient for m in hm.from_json(got.history)] == [None, "functions.f"]
    assert again.get("resp_2") is None
    assert again.delete("resp_1") and not again.delete("resp_1")
    assert again.get("resp_1") is None
    again.close()


def test_concurrent_writers_and_readers(spec):
    store = open_store(spec)
    errors = []

    def work(k):
        try:
            for i in range(40):
                store.put({"id": f"{k}-{i}"}, "[]", {}, [])
                assert store.get(f"{k}-{i}").response == {"id": f"{k}-{i}"}
        except Exception as exc:  # reported below; a thread's assert would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(store.get(f"{k}-39") for k in range(6))
    store.close()


def test_two_stores_on_one_database_see_each_other(spec):
    """What replicas rely on: a write through one is read through the other at once."""
    a, b = open_store(spec), open_store(spec)
    a.put({"id": "r"}, "[]", {"c": "f"}, [])
    assert b.get("r").calls == {"c": "f"}
    assert b.delete("r") and a.get("r") is None
    a.close()
    b.close()


def test_default_path_is_under_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTOSS_MAX_DATA", str(tmp_path))
    assert default_path() == tmp_path / "responses.sqlite3"
    open_store().put({"id": "r"}, "{}", {}, [])
    assert (tmp_path / "responses.sqlite3").exists()


def test_store_specs_pick_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path / "x.db")), SQLiteStore)
    assert isinstance(open_store(tmp_path / "y.db"), SQLiteStore)
    with pytest.raises(psycopg.OperationalError):  # a PostgreSQL URL goes to PostgreSQL, here refused
        open_store("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2")
    assert describe("postgresql://u:secret@db.example:5433/app") == "postgresql://u@db.example:5433/app"


def test_sqlite_store_from_before_versions_is_upgraded(tmp_path):
    """The first store had the table but no version mark: it is version 1, its rows kept."""
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, "
               "response TEXT NOT NULL, history TEXT NOT NULL, calls TEXT NOT NULL)")  # fmt: skip
    db.execute("INSERT INTO responses VALUES ('old', 1.0, '{\"id\": \"old\"}', '[]', '{}')")
    db.commit()
    db.close()
    store = SQLiteStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    old = store.get("old")
    assert old.response == {"id": "old"} and old.input_items == []  # version 2's column, empty for old rows
    store.put({"id": "new"}, "[]", {}, [{"type": "message", "id": "msg_1"}])
    assert store.get("new").input_items == [{"type": "message", "id": "msg_1"}]


def test_sqlite_store_from_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "new.sqlite3"
    SQLiteStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNew, match=f"schema version {SCHEMA_VERSION + 1}"):
        SQLiteStore(path)


def test_postgres_store_from_a_newer_version_is_refused(pg_url):  # noqa: F811
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE gptoss_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaTooNew):
        PostgresStore(pg_url)


def test_postgres_store_at_version_1_is_upgraded(pg_url):  # noqa: F811
    """A database a version-1 gptoss-max wrote: its rows are kept, with no input items."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE gptoss_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO gptoss_schema VALUES (1)")
        conn.execute("CREATE TABLE gptoss_responses (id TEXT PRIMARY KEY, created_at DOUBLE PRECISION NOT NULL, "
                     "response TEXT NOT NULL, history TEXT NOT NULL, calls TEXT NOT NULL)")  # fmt: skip
        conn.execute("INSERT INTO gptoss_responses VALUES ('old', 1.0, '{\"id\": \"old\"}', '[]', '{}')")
    store = PostgresStore(pg_url)
    assert store.schema_version() == SCHEMA_VERSION == 3
    old = store.get("old")
    assert old.response == {"id": "old"} and old.input_items == []
    store.put({"id": "new"}, "[]", {}, [{"type": "message", "id": "msg_1"}])
    assert store.get("new").input_items == [{"type": "message", "id": "msg_1"}]
    store.close()


def test_postgres_replicas_starting_together_migrate_once(pg_url):  # noqa: F811
    stores, errors = [], []

    def open_one():
        try:
            stores.append(PostgresStore(pg_url))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 6
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*), min(version) FROM gptoss_schema").fetchone() == (1, SCHEMA_VERSION)
    for s in stores:
        s.close()


def test_postgres_store_survives_a_dropped_connection(pg_url):  # noqa: F811
    store = PostgresStore(pg_url, pool_size=1)
    store.put({"id": "a"}, "[]", {}, [])
    with psycopg.connect(pg_url, autocommit=True) as admin:  # what a database restart does to it
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")  # fmt: skip
    assert store.get("a").response == {"id": "a"}
    store.close()


def _turns(n: int) -> tuple[list[str], list[list], list[list[dict]]]:
    """A conversation of n turns as the server stores it: after turn i, the whole history (user and
    assistant messages so far) and the input items (every earlier input and output item)."""
    messages, items, histories, msgs, itemss = [], [], [], [], []
    for i in range(n):
        messages += [hm.user(f"question {i} " + "x" * 200), hm.assistant(f"answer {i}")]
        items += [{"type": "message", "id": f"msg_in{i}"}, {"type": "message", "id": f"msg_out{i}"}]
        histories.append(hm.to_json(messages))
        msgs.append(list(messages))
        itemss.append(list(items))
    return histories, msgs, itemss


def _put_chain(store, n: int, prefix: str = "r") -> tuple[list[str], list[list[dict]]]:
    """n responses, each continuing the one before, stored with their parent named as the server does."""
    from gptoss_max.server.store import Parent

    histories, msgs, itemss = _turns(n)
    for i in range(n):
        parent = Parent(f"{prefix}{i - 1}", len(msgs[i - 1]), len(itemss[i - 1])) if i else None
        store.put({"id": f"{prefix}{i}", "turn": i}, histories[i], {f"c{i}": "f"}, itemss[i], parent)
    return histories, itemss


def _raw_rows(spec, cols: str = "parent_id, hidden, length(history)") -> dict[str, tuple]:
    """id -> those columns, as the backend holds them."""
    sql = f"SELECT id, {cols} FROM {{}}"
    if spec.startswith("postgresql"):
        with psycopg.connect(spec) as conn:
            rows = conn.execute(sql.format("gptoss_responses")).fetchall()
    else:
        with sqlite3.connect(spec) as db:
            rows = db.execute(sql.format("responses")).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def test_a_continued_response_is_stored_as_what_it_adds(spec):
    """A 40-turn conversation takes rows whose histories add up to about one whole history (each row
    holds its own turn), not the sum of 40 growing ones; every response reads back whole."""
    store = open_store(spec)
    histories, itemss = _put_chain(store, 40)
    for i in (0, 1, 17, 39):
        got = store.get(f"r{i}")
        assert got.response == {"id": f"r{i}", "turn": i} and got.calls == {f"c{i}": "f"}
        assert hm.from_json(got.history) == hm.from_json(histories[i])
        assert got.input_items == itemss[i]
    rows = _raw_rows(spec)
    assert rows["r0"][0] is None and all(rows[f"r{i}"][0] == f"r{i - 1}" for i in range(1, 40))
    stored = sum(r[2] for r in rows.values())
    assert stored < 1.5 * len(histories[-1]), (stored, len(histories[-1]))  # whole rows: ~20x
    store.close()


def test_deleting_a_continued_response_keeps_its_children_whole(spec):
    store = open_store(spec)
    histories, itemss = _put_chain(store, 4)
    assert store.delete("r1")
    assert store.get("r1") is None and not store.delete("r1"), "gone for the API"
    assert _raw_rows(spec, "hidden, response")["r1"] == (1, "{}"), "hidden, its response object dropped"
    got = store.get("r3")
    assert hm.from_json(got.history) == hm.from_json(histories[3]) and got.input_items == itemss[3]
    assert store.delete("r2") and hm.from_json(store.get("r3").history) == hm.from_json(histories[3])
    assert store.delete("r3")  # the last child of the hidden r2 and r1: they go with it
    assert set(_raw_rows(spec)) == {"r0"}
    assert store.get("r0").input_items == itemss[0]
    store.close()


def test_a_response_whose_parent_was_deleted_meanwhile_is_stored_whole(spec):
    from gptoss_max.server.store import Parent

    store = open_store(spec)
    histories, msgs, itemss = _turns(2)
    store.put({"id": "a"}, histories[0], {}, itemss[0])
    assert store.delete("a")  # after the server read it, before the answer is stored
    store.put({"id": "b"}, histories[1], {}, itemss[1], Parent("a", len(msgs[0]), len(itemss[0])))
    assert _raw_rows(spec)["b"][0] is None
    got = store.get("b")
    assert hm.from_json(got.history) == hm.from_json(histories[1]) and got.input_items == itemss[1]
    store.close()


def test_children_put_while_their_parent_is_deleted_stay_whole(spec):
    """The race `put` and `delete` run: every child either names a parent that is kept, or holds
    the whole conversation."""
    from gptoss_max.server.store import Parent

    store = open_store(spec)
    histories, msgs, itemss = _turns(2)
    store.put({"id": "p"}, histories[0], {}, itemss[0])
    parent = Parent("p", len(msgs[0]), len(itemss[0]))
    errors = []

    def child(k):
        try:
            store.put({"id": f"c{k}"}, histories[1], {}, itemss[1], parent)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=child, args=(k,)) for k in range(12)]
    threads.insert(6, threading.Thread(target=lambda: store.delete("p")))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and store.get("p") is None
    for k in range(12):
        got = store.get(f"c{k}")
        assert hm.from_json(got.history) == hm.from_json(histories[1]) and got.input_items == itemss[1]
    store.close()


def test_a_broken_chain_reads_as_missing(tmp_path, caplog):
    path = tmp_path / "r.sqlite3"
    store = SQLiteStore(path)
    _put_chain(store, 3)
    with sqlite3.connect(path) as db:  # what only an outside hand could do
        db.execute("DELETE FROM responses WHERE id = 'r0'")
    assert store.get("r2") is None and "r.sqlite3: r2 is broken at r0" in caplog.text
    assert "question" not in caplog.text, "names the response, does not print its conversation"
    with sqlite3.connect(path) as db:  # a cycle: read as broken, not followed forever
        db.execute("UPDATE responses SET parent_id = 'r2' WHERE id = 'r1'")
    assert store.get("r2") is None
    store.close()


def test_a_version_2_sqlite_store_is_upgraded_and_its_rows_continued(tmp_path):
    from gptoss_max.server.store import MIGRATIONS, Parent

    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    for statements in MIGRATIONS[:2]:
        for sql in statements:
            db.execute(sql)
    histories, msgs, itemss = _turns(2)
    db.execute("INSERT INTO responses (id, created_at, response, history, calls, input_items) "
               "VALUES ('old', 1.0, '{\"id\": \"old\"}', ?, '{}', ?)",
               (histories[0], json.dumps(itemss[0])))  # fmt: skip
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    store = SQLiteStore(path)
    assert store.schema_version() == SCHEMA_VERSION == 3
    assert store.get("old").input_items == itemss[0]
    store.put({"id": "new"}, histories[1], {}, itemss[1], Parent("old", len(msgs[0]), len(itemss[0])))
    got = store.get("new")
    assert hm.from_json(got.history) == hm.from_json(histories[1]) and got.input_items == itemss[1]
    assert _raw_rows(str(path))["new"][0] == "old"
    with sqlite3.connect(path) as db:
        (raw,) = db.execute("SELECT history FROM responses WHERE id = 'new'").fetchone()
    with pytest.raises(KeyError):  # what a replica still on version 2 would do with it: fail, not
        hm.from_json(raw)  # continue the conversation without its first turn
    store.close()


def test_prune_deletes_old_responses_and_keeps_newer_turns_whole(spec):
    store = open_store(spec)
    histories, itemss = _put_chain(store, 4)
    store.put({"id": "old"}, "{}", {}, [])
    store.put({"id": "new"}, "{}", {}, [])
    ages = {"r0": 100.0, "r1": 200.0, "r2": 300.0, "old": 50.0}  # r3 and new: now
    sql = "UPDATE {} SET created_at = %s WHERE id = %s"
    if spec.startswith("postgresql"):
        with psycopg.connect(spec, autocommit=True) as conn:
            for k, v in ages.items():
                conn.execute(sql.format("gptoss_responses"), (v, k))
    else:
        with sqlite3.connect(spec) as db:
            db.executemany(sql.format("responses").replace("%s", "?"), [(v, k) for k, v in ages.items()])
    assert store.prune(1000.0, batch=2) == 4
    assert [store.get(k) for k in ("r0", "r1", "r2", "old")] == [None] * 4
    got = store.get("r3")
    assert hm.from_json(got.history) == hm.from_json(histories[3]) and got.input_items == itemss[3]
    assert _raw_rows(spec, "hidden") == {"r0": (1,), "r1": (1,), "r2": (1,), "r3": (0,), "new": (0,)}
    assert store.prune(1000.0) == 0
    assert store.delete("r3") and set(_raw_rows(spec)) == {"new"}
    store.close()
