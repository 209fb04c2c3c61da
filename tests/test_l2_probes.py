"""CPU checks of the two probes behind bench/NOTES.md's "Loading the next weight during a
latency-bound kernel" (scripts/l2_prefetch_probe.py, scripts/pdl_preload_probe.py + .cu). Their
GPU parts need CuPy / nvcc and a GPU; the results are committed under bench/results/."""

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
