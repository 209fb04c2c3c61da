"""Load and disconnects against a running server: N concurrent streaming clients (official SDK).

    python bench/load.py --base-url http://127.0.0.1:8000 -n 256                  # load
    python bench/load.py --base-url http://127.0.0.1:8000 -n 100 --drop 100       # disconnects

Every client streams one `/v1/responses` request (`stream: true`); `--drop K` of them
(spread among the others) close their stream after their first `--drop-after` text deltas.
Each stream must end properly: a terminal event (`response.completed`, `.incomplete`,
`.failed`), or an HTTP error in OpenAI's shape (429 when the queue is full, 503 while
draining); anything else (a 5xx, a cut connection, a stream without its terminal event) is
counted as an improper error. Printed and written as JSON (`--out`, default under
`bench/results/`), p50 and p99 of: time to first token (TTFT: the stream's first event,
which this server sends once the first token is generated), time to the first text delta,
inter-token latency (ITL: gaps between text deltas) and time per output token after the
first (TPOT, from the usage); errors by kind; and from the
server's `/metrics`: generations cancelled, and MAX's KV cache (blocks in use, requests
holding blocks) before, at peak and after, with how long the cache took to be released.
After the run one more request must succeed and `/health` must answer: the server keeps
serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

RESULTS = Path(__file__).resolve().parent / "results"
TERMINAL = {"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}
PROPER_HTTP = {429, 503}  # refusals a client is meant to retry
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
METRIC = re.compile(r"^(gptoss_kv_blocks_used|gptoss_kv_blocks_total|gptoss_kv_requests|gptoss_cancelled_total)"
                    r"(?:\{[^}]*\})? (\S+)$", re.M)  # fmt: skip


@dataclass
class Result:
    dropper: bool
    outcome: str = "pending"  # completed | incomplete | failed | dropped | error
    error: str | None = None  # its kind, for an error
    proper: bool = True  # False: a 5xx, a cut connection, a stream without its terminal event
    ttft_s: float | None = None  # the first event: this server sends it once the first token exists
    deltas: list[float] = field(default_factory=list)  # text delta arrival times, s after the request
    end_s: float | None = None  # the terminal event
    output_tokens: int | None = None


def _error_kind(exc: BaseException) -> tuple[str, bool]:
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        shaped = isinstance(body.get("error", body), dict) and "message" in body.get("error", body)
        return f"http_{exc.status_code}", exc.status_code in PROPER_HTTP and shaped
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", False
    if isinstance(exc, openai.APIConnectionError):
        return "connection", False
    return type(exc).__name__, False


async def one(client: openai.AsyncOpenAI, body: dict[str, Any], dropper: bool, drop_after: int) -> Result:
    res = Result(dropper)
    t0 = time.perf_counter()
    try:
        stream = await client.responses.create(**body, stream=True)
        async with stream:
            async for event in stream:
                now = time.perf_counter() - t0
                res.ttft_s = now if res.ttft_s is None else res.ttft_s
                if event.type.endswith(".delta"):
                    res.deltas.append(now)
                    if dropper and len(res.deltas) >= drop_after:
                        res.outcome = "dropped"
                        return res  # leaving the block closes the connection mid-stream
                elif event.type in TERMINAL:
                    res.outcome, res.end_s = TERMINAL[event.type], now
                    usage = event.response.usage
                    res.output_tokens = usage.output_tokens if usage else None
        if res.outcome == "pending":
            res.outcome, res.error, res.proper = "error", "truncated_stream", False
    except Exception as exc:  # noqa: BLE001 - every failure is a figure here
        res.outcome = "error"
        res.error, res.proper = _error_kind(exc)
    return res


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)  # nearest rank
    return values[min(len(values), max(1, math.ceil(q / 100 * len(values)))) - 1]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


def metrics(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    return {name: float(value) for name, value in METRIC.findall(text)}


async def watch_kv(base_url: str, headers: dict[str, str], peak: dict[str, float], stop: asyncio.Event) -> None:
    """The KV cache's peak while the clients run."""
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            try:
                text = (await http.get(f"{base_url}/metrics", headers=headers)).text
            except httpx.HTTPError:
                text = ""
            for name, value in METRIC.findall(text):
                if name.startswith("gptoss_kv"):
                    peak[name] = max(peak.get(name, 0.0), float(value))
            await asyncio.sleep(0.25)


def wait_released(base_url: str, headers: dict[str, str], baseline: dict[str, float], timeout: float) -> float | None:
    """Seconds until the worker holds no request's KV blocks and uses no more blocks than before."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        m = metrics(base_url, headers)
        if "gptoss_kv_requests" not in m:
            return None  # no KV figures (not MAX's engine)
        if m["gptoss_kv_requests"] == 0 and m["gptoss_kv_blocks_used"] <= baseline.get("gptoss_kv_blocks_used", 0):
            return time.perf_counter() - t0
        time.sleep(0.1)
    return None


async def run_clients(base_url: str, api_key: str, body: dict[str, Any], n: int, drop: int, drop_after: int,
                      timeout: float) -> tuple[list[Result], float, dict[str, float]]:  # fmt: skip
    # The SDK's own connection pool (up to 1000 connections) is left as it is.
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    droppers = {round(i * n / drop) for i in range(drop)} if drop else set()
    headers = {"authorization": f"Bearer {api_key}"}
    peak: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_kv(base_url, headers, peak, stop))
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(client, body, i in droppers, drop_after) for i in range(n)))
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        await watcher
        await client.close()
    return list(results), wall, peak


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    kept = [r for r in results if not r.dropper and r.outcome in TERMINAL.values()]
    ttft = [r.ttft_s for r in kept if r.ttft_s is not None]
    first_delta = [r.deltas[0] for r in kept if r.deltas]
    gaps = [b - a for r in kept for a, b in zip(r.deltas, r.deltas[1:], strict=False)]
    tpot = [(r.end_s - r.ttft_s) / (r.output_tokens - 1) for r in kept
            if r.output_tokens and r.output_tokens > 1 and r.end_s is not None and r.ttft_s is not None]  # fmt: skip
    outcomes: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    tokens = sum(r.output_tokens or 0 for r in results)
    return {
        "clients": len(results),
        "droppers": sum(r.dropper for r in results),
        "wall_s": round(wall, 3),
        "outcomes": outcomes,
        "errors_by_kind": errors,
        "improper_errors": sum(not r.proper for r in results),
        "dropped_before_first_delta": sum(r.dropper and r.outcome != "dropped" for r in results),
        "ttft_ms": {"p50": _ms(pct(ttft, 50)), "p99": _ms(pct(ttft, 99)), "n": len(ttft)},
        "first_delta_ms": {"p50": _ms(pct(first_delta, 50)), "p99": _ms(pct(first_delta, 99)), "n": len(first_delta)},
        "itl_ms": {"p50": _ms(pct(gaps, 50)), "p99": _ms(pct(gaps, 99)), "n": len(gaps)},
        "tpot_ms": {"p50": _ms(pct(tpot, 50)), "p99": _ms(pct(tpot, 99)), "n": len(tpot)},
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 2) if wall > 0 else None,
    }


def run(base_url: str, *, api_key: str = "unused", model: str | None = None, n: int = 256, drop: int = 0,
        drop_after: int = 2, max_output_tokens: int = 64, prompt: str = "Tell me about lighthouses.",
        temperature: float = 1.0, json_answer: bool = False, timeout: float = 600.0,
        release_timeout: float = 60.0) -> dict[str, Any]:  # fmt: skip
    """The whole benchmark against `base_url` (without /v1); the report."""
    if not 0 <= drop <= n:
        raise ValueError("--drop must be between 0 and -n")
    headers = {"authorization": f"Bearer {api_key}"}
    served = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]
    model = model or served["id"]
    body = {"model": model, "input": prompt, "max_output_tokens": max_output_tokens, "temperature": temperature,
            "reasoning": {"effort": "low"}}  # fmt: skip
    if json_answer:
        body["text"] = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    before = metrics(base_url, headers)
    results, wall, peak = asyncio.run(run_clients(base_url, api_key, body, n, drop, drop_after, timeout))
    released_s = wait_released(base_url, headers, before, release_timeout) if drop else None
    after = metrics(base_url, headers)
    check = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    follow = check.responses.create(model=model, input="Still there?", max_output_tokens=8)
    health = httpx.get(f"{base_url}/health", timeout=10)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "server": {"base_url": base_url, "model": model, "max_model_len": served.get("max_model_len")},
        "client_host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "config": {"n": n, "drop": drop, "drop_after_deltas": drop_after, "max_output_tokens": max_output_tokens,
                   "prompt": prompt, "temperature": temperature, "json_answer": json_answer},  # fmt: skip
        **summarize(results, wall),
        "cancelled": after.get("gptoss_cancelled_total", 0) - before.get("gptoss_cancelled_total", 0),
        "kv": {
            "before": {k: v for k, v in before.items() if k.startswith("gptoss_kv")},
            "peak": peak,
            "after": {k: v for k, v in after.items() if k.startswith("gptoss_kv")},
            "released_after_s": None if released_s is None else round(released_s, 2),
        },
        "after_run": {"request_status": follow.status, "request_s": round(time.perf_counter() - t0, 3),
                      "health": health.status_code},  # fmt: skip
    }
    report["ok"] = (
        report["improper_errors"] == 0
        and follow.status in ("completed", "incomplete")
        and health.status_code == 200
        and (not drop or not before.get("gptoss_kv_blocks_total") or released_s is not None)
    )
    return report


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['clients']} streams ({r['droppers']} dropping) against {r['server']['model']} in {r['wall_s']} s")
    print(f"  outcomes {r['outcomes']}; errors by kind {r['errors_by_kind'] or 'none'}; "
          f"improper {r['improper_errors']}")  # fmt: skip
    for name in ("ttft_ms", "first_delta_ms", "itl_ms", "tpot_ms"):
        print(f"  {name:8s} p50 {r[name]['p50']}  p99 {r[name]['p99']}  (n={r[name]['n']})")
    print(f"  output {r['output_tokens']} tokens, {r['output_tok_per_s']} tok/s; cancelled by the server: "
          f"{r['cancelled']:.0f}")  # fmt: skip
    kv = r["kv"]
    if kv["before"]:
        print(f"  KV before {kv['before']}, peak {kv['peak']}, after {kv['after']}, "
              f"released after {kv['released_after_s']} s")  # fmt: skip
    print(f"  afterwards: one request {r['after_run']['request_status']} in {r['after_run']['request_s']} s, "
          f"/health {r['after_run']['health']} -> {'OK' if r['ok'] else 'NOT OK'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--api-key", default=os.environ.get("GPTOSS_MAX_API_KEY") or "unused")
    p.add_argument("--model", default=None, help="default: the one the server serves")
    p.add_argument("-n", type=int, default=256, help="concurrent streaming clients")
    p.add_argument("--drop", type=int, default=0, help="how many of them close their stream mid-way")
    p.add_argument("--drop-after", type=int, default=2, help="text deltas a dropping client reads first")
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Tell me about lighthouses.")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--json", action="store_true",
                   help="ask for a JSON answer (a json_schema format): the server's grammar then keeps even a "
                        "random model's output well-formed Harmony, whose text streams token by token")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--tag", default="", help="goes into the result file's name")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default: bench/results/load_*.json)")
    args = p.parse_args(argv)
    report = run(args.base_url, api_key=args.api_key, model=args.model, n=args.n, drop=args.drop,
                 drop_after=args.drop_after, max_output_tokens=args.max_output_tokens, prompt=args.prompt,
                 temperature=args.temperature, json_answer=args.json, timeout=args.timeout)  # fmt: skip
    print_report(report)
    out = args.out or RESULTS / f"load_{args.tag + '_' if args.tag else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
