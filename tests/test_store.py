"""The SQLite response store."""

import threading

from gptoss_max.harmony import messages as hm
from gptoss_max.server.store import ResponseStore, default_path


def test_put_get_delete_and_reopen(tmp_path):
    path = tmp_path / "sub" / "r.sqlite3"
    history = hm.to_json([hm.user("hi"), hm.function_call("f", "{}")])
    store = ResponseStore(path)
    store.put({"id": "resp_1", "output": []}, history, {"call_1": "f"})
    store.put({"id": "resp_1", "output": [1]}, history, {"call_1": "f"})  # replaces
    store.close()
    again = ResponseStore(path)
    got = again.get("resp_1")
    assert got.response == {"id": "resp_1", "output": [1]} and got.calls == {"call_1": "f"}
    assert [m.recipient for m in hm.from_json(got.history)] == [None, "functions.f"]
    assert again.get("resp_2") is None
    assert again.delete("resp_1") and not again.delete("resp_1")
    assert again.get("resp_1") is None


def test_default_path_is_under_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTOSS_MAX_DATA", str(tmp_path))
    assert default_path() == tmp_path / "responses.sqlite3"
    ResponseStore().put({"id": "r"}, "{}", {})
    assert (tmp_path / "responses.sqlite3").exists()


def test_concurrent_writers(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")

    def write(k):
        for i in range(50):
            store.put({"id": f"{k}-{i}"}, "{}", {})

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(store.get(f"{k}-49") for k in range(4))
