"""Which CPUs a process's threads run on, and how much each thread has run (Linux).

A replayed decode step is bound by the host's Python when the host slows (bench/NOTES.md,
"Fourteenth session": the 20b's slow stretches on the H200 are the host's work per step growing
~1.5x, which is what sharing a core with a busy hyperthread sibling costs). `isolate_main_thread`
gives the calling (main) thread a CPU of its own: the process's other threads are moved off that
CPU and its hyperthread siblings. `thread_cpu_seconds` says which threads used the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

_TASKS = Path("/proc/self/task")


def siblings(cpu: int, sysfs: Path = Path("/sys/devices/system/cpu")) -> set[int]:
    """`cpu` and its hyperthread siblings (just `cpu` where the topology is not readable)."""
    try:
        text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    found: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        found.update(range(int(lo), int(hi or lo) + 1))
    return found | {cpu}


def thread_ids() -> list[int]:
    return sorted(int(t) for t in os.listdir(_TASKS))


def isolate_main_thread(cpu: int | None = None) -> dict[str, Any]:
    """Pin the calling thread to `cpu` (default: the highest this process may use), and move every
    other thread of the process that may run on `cpu` or its siblings to the allowed CPUs outside
    that sibling set (`keep_isolated`; threads already kept off it stay as they are). Threads
    started later inherit their creator's set: call again after start-up work that starts threads,
    or keep `keep_isolating` running.

    Returns what was done (`isolated` False, with `reason`, where there is no CPU to spare)."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed) if cpu is None else cpu
    if cpu not in allowed:
        return {"isolated": False, "reason": f"CPU {cpu} is not among the allowed {sorted(allowed)}"}
    shared = siblings(cpu)
    others = allowed - shared
    if not others:
        return {"isolated": False, "reason": f"no allowed CPU outside {sorted(shared)}"}
    me = threading.get_native_id()
    moved = keep_isolated(me, shared, others)
    os.sched_setaffinity(0, {cpu})
    return {"isolated": True, "cpu": cpu, "siblings": sorted(shared), "others": len(others),
            "other_cpus": sorted(others), "threads_moved": moved}  # fmt: skip


def keep_isolated(tid: int, shared: set[int], others: set[int]) -> int:
    """Move every thread of this process but `tid` that may run on a CPU of `shared` to `others`
    (e.g. threads started after `isolate_main_thread`, which inherit the pinned thread's CPU);
    returns how many were moved."""
    moved = 0
    for t in thread_ids():
        if t == tid:
            continue
        try:
            if os.sched_getaffinity(t) & shared:
                os.sched_setaffinity(t, others)
                moved += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return moved


def keep_isolating(state: dict[str, Any], tid: int, interval: float = 1.0) -> threading.Thread | None:
    """After `isolate_main_thread` returned `state` in thread `tid`: a daemon thread that runs
    `keep_isolated` every `interval` s, so threads the process starts later (a pool's workers, a
    grammar compiler's) leave the isolated core too. None where nothing was isolated."""
    if not state.get("isolated"):
        return None
    shared, others = set(state["siblings"]), set(state["other_cpus"])

    def run() -> None:
        while True:
            keep_isolated(tid, shared, others)
            time.sleep(interval)

    thread = threading.Thread(target=run, name="gptoss-isolation", daemon=True)
    thread.start()
    return thread


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Each thread of this process: (its name, the CPU seconds it has run, user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in thread_ids():
        try:
            stat = (_TASKS / str(tid) / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def busiest_threads(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], top: int = 6):
    """The `top` threads by CPU seconds between two `thread_cpu_seconds()` readings, as
    [name, tid, seconds], busiest first (threads started in between count from 0)."""
    used = [(name, tid, s - before.get(tid, (name, 0.0))[1]) for tid, (name, s) in after.items()]
    used.sort(key=lambda row: -row[2])
    return [[name, tid, round(s, 3)] for name, tid, s in used[:top]]
