"""`gptoss-max make-tiny DIR && gptoss-max generate --model DIR --prompt hi --max-new-tokens 8`, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli_proc(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "gptoss_max.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),  # MAX's native library setenv()s PYTHONEXECUTABLE; os.environ does not carry it
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_cli(*args: str, timeout: int = 1200) -> str:
    return run_cli_proc(*args, timeout=timeout).stdout


def test_make_tiny_then_generate(tmp_path):
    out = run_cli("make-tiny", str(tmp_path / "t"))
    assert "wrote a tiny gpt-oss checkpoint" in out
    out = run_cli("generate", "--model", str(tmp_path / "t"), "--prompt", "hi", "--max-new-tokens", "8")
    assert "on CPU" in out
    last = out.strip().splitlines()[-1]
    assert "tokens; time to first token" in last and "tok/s" in last
    n_tokens = int(last.split()[0])
    assert 1 <= n_tokens <= 8
    # --deterministic: the model is built with MAX's device_sync_mode (logged), same tokens (the CPU
    # graph is the same one: a CPU graph always runs our attention)
    det = run_cli_proc("-v", "generate", "--model", str(tmp_path / "t"), "--prompt", "hi", "--max-new-tokens", "8",
                       "--deterministic")  # fmt: skip
    assert "GPTOSS_MAX_DETERMINISTIC=on: MAX's device_sync_mode" in det.stderr
    assert "device_sync_mode is off" not in det.stderr  # the CLI exports MODULAR_DEBUG before MAX is imported

    def channels(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("[")]

    assert channels(det.stdout) == channels(out) and channels(out)
    assert det.stdout.strip().splitlines()[-1].split()[0] == str(n_tokens)


def test_help_lists_commands():
    out = run_cli("--help")
    for cmd in ("make-tiny", "make-checkpoint", "generate", "serve", "bench"):
        assert cmd in out


def test_prune_store(tmp_path, capsys):
    from gptoss_max.cli import main
    from gptoss_max.server.store import SQLiteStore

    path = tmp_path / "r.sqlite3"
    store = SQLiteStore(path)
    store.put({"id": "a"}, "{}", {}, [])
    store.put({"id": "b"}, "{}", {}, [])
    store.close()
    assert main(["prune-store", "--store", str(path), "--older-than", "1"]) == 0
    assert "deleted 0 stored responses older than 1 days" in capsys.readouterr().out
    assert main(["prune-store", "--store", str(path), "--older-than", "0"]) == 0
    assert "deleted 2 stored responses" in capsys.readouterr().out
    assert SQLiteStore(path).get("a") is None
    with pytest.raises(SystemExit):
        main(["prune-store", "--store", str(path), "--older-than", "-1"])
