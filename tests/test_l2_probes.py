"""CPU checks of the two probes behind bench/NOTES.md's "Loading the next weight during a
latency-bound kernel" (scripts/l2_prefetch_probe.py, scripts/pdl_preload_probe.py + .cu) and of
scripts/probe_common.py, which they share with gpu_mem_probe.py. Their GPU parts need CuPy / nvcc
and a GPU; the results are committed under bench/results/."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _defines() -> dict[str, int]:
    src = (SCRIPTS / "pdl_preload_probe.cu").read_text()
    return {k: int(v) for k, v in re.findall(r"^#define (ROWS|COLS|RB) (\d+)$", src, flags=re.M)}


def test_l2_probe_weight_is_o_proj_and_prefetch_ranges_are_aligned():
    p = _load("l2_prefetch_probe")
    assert p.WEIGHT_BYTES == 2880 * 64 * 64 * 2  # gpt-oss o_proj: hidden x (64 heads x 64), bf16
    for frac in (0.0, 0.5, 1.0, 1 / 3):
        n = p.prefetch_bytes(frac)
        assert n % 16 == 0 and 0 <= n <= p.WEIGHT_BYTES  # cp.async.bulk.prefetch sizes: multiples of 16
    assert p.prefetch_bytes(1.0) == p.WEIGHT_BYTES
    labels = [v[0] for v in p.VARIANTS]
    assert len(labels) == len(set(labels))
    assert all(len(v) == 7 for v in p.VARIANTS)
    # the baseline rows the note compares against are measured
    assert "gemv alone (weight from DRAM)" in labels and "chain 8, gemv" in labels


def test_pdl_probe_blocks_fit_the_gpu_at_once():
    d = _defines()
    assert (d["ROWS"], d["COLS"]) == (2880, 4096)
    blocks = -(-d["ROWS"] // d["RB"])
    assert blocks <= 132  # one block per SM of an H100: every block preloads while the first kernel runs
    assert d["RB"] * d["COLS"] * 2 <= 227 * 1024  # a block's rows fit the opt-in shared memory
    assert d["COLS"] % (8 * 32) == 0  # whole 16-byte chunks per lane
    p = _load("pdl_preload_probe")
    assert p.WEIGHT_BYTES == d["ROWS"] * d["COLS"] * 2


def test_pdl_probe_builds_for_sm90a(monkeypatch, tmp_path):
    p = _load("pdl_preload_probe")
    seen = []
    monkeypatch.setattr(p.subprocess, "run", lambda cmd, check: seen.append(cmd))
    exe = p.build(tmp_path, "nvcc")
    assert seen and "-arch=sm_90a" in seen[0] and str(SCRIPTS / "pdl_preload_probe.cu") in seen[0]
    assert exe.parent == tmp_path


class _FakeCupy:
    """Enough of CuPy's stream / event / graph API to run graph_us_per_launch on the CPU: each
    replay of the captured graph 'takes' 2 ms per captured launch."""

    def __init__(self):
        self.calls, self.capturing, self.captured = [], False, 0
        fake = self

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

            def begin_capture(self):
                fake.capturing = True

            def end_capture(self):
                fake.capturing = False

                class Graph:
                    def launch(self, stream):
                        fake.calls.append("replay")

                return Graph()

        class Event:
            def record(self, stream):
                pass

            def synchronize(self):
                pass

        class Cuda:
            pass

        Cuda.Stream, Cuda.Event = Stream, Event
        Cuda.get_elapsed_time = staticmethod(lambda a, b: 2.0 * fake.captured)
        self.cuda = Cuda

    def launch(self, i):
        self.calls.append(("capture" if self.capturing else "warm", i))
        if self.capturing:
            self.captured += 1


def test_graph_timing_warms_captures_and_divides_by_the_chain():
    pc = _load("probe_common")
    cp = _FakeCupy()
    us = pc.graph_us_per_launch(cp, cp.launch, warm=3, chain=5, reps=4)
    assert [c for c in cp.calls if c[0] == "warm"] == [("warm", i) for i in range(3)]
    assert [c for c in cp.calls if c[0] == "capture"] == [("capture", i) for i in range(5)]
    assert cp.calls.count("replay") == 1 + 4  # one untimed replay, then the timed ones
    assert us == 2.0 * 5 * 1e3 / 5  # ms per replay -> us per launch


def test_write_result_names_the_file_and_leads_with_device_date_command(tmp_path):
    import json

    pc = _load("probe_common")
    path = pc.write_result(str(tmp_path), "x_probe", "NVIDIA H100 80GB HBM3", "x.py", ["--reps", "3"], {"rows": [1]})
    assert path.parent == tmp_path and path.name.startswith("x_probe_h100_") and path.suffix == ".json"
    d = json.loads(path.read_text())
    assert list(d)[:3] == ["device", "date", "command"] and d["command"] == "python3 scripts/x.py --reps 3"
    assert d["rows"] == [1]
