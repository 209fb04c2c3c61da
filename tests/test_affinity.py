"""gptoss_max.affinity: the main thread on a CPU of its own, and which threads used the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

from gptoss_max import affinity


def test_siblings_reads_the_topologys_lists_and_ranges(tmp_path):
    for cpu, text, want in [(0, "0-1\n", {0, 1}), (4, "0,4", {0, 4}), (3, "3", {3}), (2, "8-9,2", {2, 8, 9})]:
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text)
        assert affinity.siblings(cpu, tmp_path) == want
    assert affinity.siblings(7, tmp_path) == {7}  # unreadable: the CPU alone


def test_isolating_pins_the_caller_and_moves_the_other_threads_off_its_core():
    # in a child process: pinning the test process's own main thread would outlive the test
    script = textwrap.dedent(
        """
        import json, os, threading
        from gptoss_max import affinity
        go = threading.Event()
        other = threading.Thread(target=go.wait)
        other.start()
        done = affinity.isolate_main_thread()
        print(json.dumps({"done": done, "main": sorted(os.sched_getaffinity(0)),
                          "other": sorted(os.sched_getaffinity(other.native_id))}))
        go.set()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=os.environ)
    got = json.loads(out.stdout)
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    shared = affinity.siblings(cpu)
    if allowed - shared:
        assert got["done"] == {"isolated": True, "cpu": cpu, "siblings": sorted(shared),
                               "others": len(allowed - shared), "other_cpus": sorted(allowed - shared),
                               "threads_moved": 1}  # fmt: skip
        assert got["main"] == [cpu] and got["other"] == sorted(allowed - shared)
    else:  # every allowed CPU shares the core: nothing to spare, nothing moved
        assert got["done"]["isolated"] is False and "no allowed CPU outside" in got["done"]["reason"]
        assert got["main"] == got["other"] == sorted(allowed)
    assert affinity.isolate_main_thread(cpu=10_000) == {
        "isolated": False,
        "reason": f"CPU 10000 is not among the allowed {sorted(allowed)}",
    }


def test_busiest_threads_names_the_thread_that_spun():
    before = affinity.thread_cpu_seconds()
    hold = threading.Event()

    def spin_then_wait():  # stays alive (in /proc) until read
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        hold.wait()

    t = threading.Thread(target=spin_then_wait)
    t.start()
    while t.native_id is None or affinity.thread_cpu_seconds().get(t.native_id, ("", 0.0))[1] < 0.25:
        time.sleep(0.02)
    top = affinity.busiest_threads(before, affinity.thread_cpu_seconds(), top=2)
    hold.set()
    t.join()
    assert top[0][1] == t.native_id and 0.25 <= top[0][2] < 5
    assert len(top) == 2 and top[1][2] <= top[0][2]


def test_threads_started_after_isolation_are_moved_off_and_serve_isolates_its_worker_thread(tmp_path):
    # in a child process, as above: `serve --isolate-scheduler-thread`'s factory isolates the thread
    # that builds the pipeline, and a thread it starts afterwards (inheriting the pinned CPU) is
    # moved off by the keeper
    script = textwrap.dedent(
        f"""
        import json, os, threading, time
        from gptoss_max import affinity
        from gptoss_max.server.kv_probe import ProbedFactory

        class Pipeline:
            kv_manager = None

        affinity.keep_isolating.__defaults__ = (0.05,)  # the keeper's interval, for the test
        ProbedFactory(Pipeline, {str(tmp_path / "kv.json")!r}, isolate=True)()
        pinned = sorted(os.sched_getaffinity(0))
        go = threading.Event()
        late = threading.Thread(target=go.wait)
        late.start()
        inherited = sorted(os.sched_getaffinity(late.native_id))
        time.sleep(0.5)
        now = sorted(os.sched_getaffinity(late.native_id))
        keeper = [t.name for t in threading.enumerate() if t.name == "gptoss-isolation"]
        print(json.dumps({{"main": pinned, "late_at_start": inherited, "late": now, "keeper": keeper}}))
        go.set()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=os.environ)
    got = json.loads(out.stdout)
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    if allowed - affinity.siblings(cpu):
        assert got["main"] == [cpu]
        # a thread inherits its creator's set, until the keeper's next pass (which may come first)
        assert got["late_at_start"] in ([cpu], sorted(allowed - affinity.siblings(cpu)))
        assert got["late"] == sorted(allowed - affinity.siblings(cpu)) and got["keeper"] == ["gptoss-isolation"]
    else:  # nothing to spare: nothing pinned, no keeper
        assert got["main"] == got["late"] == sorted(allowed) and got["keeper"] == []
    assert affinity.keep_isolating({"isolated": False, "reason": "none"}, 1) is None
