"""A throwaway PostgreSQL server for the store's tests: initdb into a directory, start, stop.

Standard library only, so `.ci/run` can call it before the venv exists:

    python3 tests/pg_server.py start DIR   # prints the server's postgresql:// URL
    python3 tests/pg_server.py stop DIR

The server listens on 127.0.0.1 (a free port) with trust authentication, and keeps its
socket, data and log under DIR. As root, it runs as the `postgres` user (initdb refuses root).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def bindir() -> Path | None:
    """PostgreSQL's server programs: on PATH, or the newest Debian/Ubuntu install."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    dirs = glob.glob("/usr/lib/postgresql/*/bin")
    dirs.sort(key=lambda d: [int(x) for x in re.findall(r"\d+", d)])
    for d in reversed(dirs):
        if (Path(d) / "initdb").exists():
            return Path(d)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_owner(root: Path) -> dict:
    if os.geteuid() != 0:
        return {}
    import pwd

    pw = pwd.getpwnam("postgres")
    for path in (root, *root.rglob("*")):
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def start(root: Path | str) -> str:
    """Initialise and start a server under `root` (created; must not hold one yet); its URL."""
    bins = bindir()
    if bins is None:
        raise FileNotFoundError("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    owner = _as_owner(root)
    data, port = root / "data", _free_port()
    run = dict(check=True, capture_output=True, text=True, **owner)
    subprocess.run([bins / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"], **run)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([bins / "pg_ctl", "-D", data, "-l", root / "server.log", "-o", opts, "-w", "start"], **run)
    (root / "url").write_text(f"postgresql://postgres@127.0.0.1:{port}/postgres")
    return (root / "url").read_text()


def stop(root: Path | str) -> None:
    root = Path(root).resolve()
    bins = bindir()
    if bins is None or not (root / "data" / "postmaster.pid").exists():
        return
    owner = _as_owner(root)
    subprocess.run([bins / "pg_ctl", "-D", root / "data", "-m", "fast", "-w", "stop"],
                   check=True, capture_output=True, **owner)  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "start":
        print(start(argv[1]))
    else:
        stop(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
