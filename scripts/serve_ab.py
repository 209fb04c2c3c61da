"""Serve flags A/B: the live server's decode speed with one set of `serve` flags against another.

`bench/e2e.py` times the engine in a worker of its own; this times `gptoss-max serve` itself (MAX's
model worker process, its scheduler, our API process), through its decode probe (`GET /bench`,
`--enable-bench`). Each variant is a string of extra `serve` flags ("" for none), after any
`NAME=value` words for that server's environment (`"GPTOSS_MAX_REPLAY_GRAPHS=all --replay-small-graphs"`).
Variants run in turn, round after round: per round each variant's server starts, answers `--repeats` probes of `--n`
concurrent requests decoding exactly `--tokens` tokens, and stops. So variants alternate, and a slow
stretch of the host lands on either. A start that would run past `--deadline` is skipped, and says so.

    export PYTHONPATH=<staged MAX site>:$PWD/src PYTHONUNBUFFERED=1 GPTOSS_MAX_CACHE=<tokenizer cache>
    python3 scripts/serve_ab.py --out $OUT --rounds 2 -- "" "--isolate-scheduler-thread"    # synthetic 20b, GPU
    python3 scripts/serve_ab.py --out DIR --model synthetic:tiny --devices cpu --tokens 8 -- "" "--graph-capture off"

(`--` ends the script's own options, so the variants may start with `--`.)

Writes `<out>/serve_ab_<gpu|cpu>_<yyyymmdd>.json` (every probe's answer, each server's start-up
time, its log's warnings and notes, and its log's tail) and prints a table: per variant, the median
of its probes' `decode_tok_per_s_per_seq`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gptoss_max.ports import free_port

SERVE = [sys.executable, "-m", "gptoss_max.cli", "serve"]
clock = time.monotonic  # (a test's stand-in clock replaces it)


def get_json(url: str, timeout: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (OSError, ValueError) as err:
        return 0, str(err)


NOTE_MARKS = ("ERROR", "WARNING", "scheduler thread isolated", "replaying device graphs", "captured graph", " calls: {")


def notes_and_tail(path: Path, n: int = 40) -> tuple[list[str], list[str]]:
    """The log's first `n` lines that say something about the run (warnings, errors, what our flags
    did), and its last `n` lines."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if any(m in line for m in NOTE_MARKS)][:n], lines[-n:]


def split_env(flags: str) -> tuple[dict[str, str], list[str]]:
    """A variant's leading `NAME=value` words (its server's environment) and its serve flags."""
    words = shlex.split(flags)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def run_variant(args: argparse.Namespace, flags: str, log: Path, deadline: float) -> dict[str, Any]:
    """Start one server with `flags`, probe it, stop it; what it answered."""
    port = free_port()
    store = log.with_suffix(".sqlite3")  # its own response store, not the data dir's
    env, serve_flags = split_env(flags)
    cmd = [*SERVE, "--model", args.model, "--devices", args.devices, "--port", str(port), "--enable-bench",
           "--store", str(store), "--max-batch-size", str(args.max_batch_size), "--max-length", str(args.max_length),
           *serve_flags]  # fmt: skip
    row: dict[str, Any] = {"flags": flags, "command": " ".join(cmd[2:]), "env": env, "probes": []}
    base = f"http://127.0.0.1:{port}"
    t0 = clock()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        while get_json(f"{base}/health", 2)[0] != 200:
            if proc.poll() is not None:
                row["error"] = f"server exited ({proc.returncode}) before it was ready"
                return row
            if clock() > deadline:
                row["error"] = "not ready before the deadline"
                return row
            time.sleep(1)
        row["ready_s"] = round(clock() - t0, 1)
        for temperature in args.temperatures:
            query = f"{base}/bench?n={args.n}&max_new_tokens={args.tokens}&temperature={temperature}"
            for _ in range(args.repeats):
                status, body = get_json(query, max(10.0, deadline - clock()))
                row["probes"].append(body if status == 200 else {"status": status, "error": body})
                if status != 200:
                    return row
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        row["log_notes"], row["log_tail"] = notes_and_tail(log)
    return row


def summarize(rows: list[dict[str, Any]], variants: list[str], temperatures: list[float]) -> list[dict[str, Any]]:
    """Per variant and sampling temperature, the probes' decode speeds and their median."""
    table = []
    for flags in variants:
        for temperature in temperatures:
            speeds = [p["decode_tok_per_s_per_seq"] for r in rows if r["flags"] == flags for p in r["probes"]
                      if isinstance(p, dict) and p.get("decode_tok_per_s_per_seq")
                      and p.get("temperature", 1.0) == temperature]  # fmt: skip
            table.append({"flags": flags or "(none)", "temperature": temperature, "probes": len(speeds),
                          "median_decode_tok_s_per_seq": round(statistics.median(speeds), 2) if speeds else None,
                          "all": speeds})  # fmt: skip
    return table


def temperatures(text: str) -> list[float]:
    values = [float(t) for t in text.split(",") if t.strip()]
    if not values or not all(0 <= t <= 2 for t in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated temperatures from 0 to 2")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", metavar="FLAGS", help='extra serve flags per variant ("" for none), after --')
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="synthetic:20b")
    p.add_argument("--devices", default="gpu")
    p.add_argument("--rounds", type=int, default=1, help="times each variant's server starts (variants alternate)")
    p.add_argument("--repeats", type=int, default=3, help="probes per server start")
    p.add_argument("--n", type=int, default=1, help="concurrent requests per probe")
    p.add_argument("--tokens", type=int, default=1024, help="tokens each request decodes (EOS ignored)")
    p.add_argument("--temperatures", type=temperatures, default=[1.0],
                   help="sampling temperatures probed per start, comma-separated (0: greedy)")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--deadline", type=float, default=560, help="seconds for the whole run")
    p.add_argument("--start-s", type=float, default=120, help="a start is skipped with less than this left")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = clock() + args.deadline
    from gptoss_max.e2e import gpu_name

    device = gpu_name() if args.devices != "cpu" else None
    tag = (device or "cpu").lower().replace("nvidia ", "").replace(" ", "_")
    command = "scripts/serve_ab.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result: dict[str, Any] = {"device": device or "cpu", "date": datetime.date.today().isoformat(),
                              "command": command, "rows": []}  # fmt: skip
    path = args.out / f"serve_ab_{tag}_{datetime.date.today():%Y%m%d}.json"
    logs = Path(tempfile.mkdtemp(prefix="serve_ab_"))
    for r in range(args.rounds):
        for i, flags in enumerate(args.variants):
            left = deadline - clock()
            if left < args.start_s:
                print(f"round {r + 1}, variant {flags!r}: {left:.0f} s left, skipped", flush=True)
                continue
            row = run_variant(args, flags, logs / f"server_{r}_{i}.log", deadline)
            row["round"] = r + 1
            result["rows"].append(row)
            speeds = [q.get("decode_tok_per_s_per_seq") for q in row["probes"] if isinstance(q, dict)]
            print(f"round {r + 1}, variant {flags or '(none)'!r}: ready {row.get('ready_s')} s, "
                  f"decode tok/s per seq {speeds} {row.get('error', '')}", flush=True)  # fmt: skip
            result["summary"] = summarize(result["rows"], args.variants, args.temperatures)
            path.write_text(json.dumps(result, indent=1))
    print("| flags | temperature | probes | median decode tok/s per seq | all |\n|---|---|---|---|---|")
    for s in result.get("summary", []):
        print(
            f"| {s['flags']} | {s['temperature']} | {s['probes']} | {s['median_decode_tok_s_per_seq']} | {s['all']} |"
        )
    print(f"wrote {path}")
    ok = result["rows"] and all("error" not in r and r["probes"] for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
