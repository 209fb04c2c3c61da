"""CPU checks of scripts/gpu_mem_probe.py (the GPU part needs CuPy and a GPU; its results are
committed as bench/results/mem_probe_*.json)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("gpu_mem_probe", ROOT / "scripts" / "gpu_mem_probe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_mem_probe"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_regions_are_one_expert_of_gpt_oss():
    p = _probe()
    assert p.GATE_UP_BYTES == 5760 * 1440  # 2I rows x H/2 bytes
    assert p.DOWN_BYTES == 2880 * 1440
    assert p.TILE == 16 * 1440  # the decode kernels' 16-row tile


def test_every_variant_reads_each_region_exactly_once():
    p = _probe()
    for region in (p.GATE_UP_BYTES, p.DOWN_BYTES):
        kept = 0
        for chunk, w, _minw, _u, _d in p.TILE_VARIANTS:
            grid = p.tile_grid(region, chunk, w)
            if grid is None:
                assert region % (chunk * w) or chunk < 512
                continue
            kept += 1
            assert grid[1] == 4
            assert grid[0] * w * chunk == region
        assert kept >= len(p.TILE_VARIANTS) - 2
    # the decode kernels' own structure is always measured
    chunk, w = p.TILE_VARIANTS[0][:2]
    assert p.tile_grid(p.GATE_UP_BYTES, chunk, w) == (180, 4)
    assert p.tile_grid(p.DOWN_BYTES, chunk, w) == (90, 4)
    assert p.tile_grid(p.DOWN_BYTES, 1000, 2) is None


def test_every_macro_has_a_default():
    """The CUDA source is compiled once per variant with -D values for its kernel only; the other
    kernels in the module must still compile, so every macro needs a default."""
    src = _probe().SOURCE
    for macro in ("CHUNK", "W", "MINB", "U", "D", "UNR"):
        assert f"#ifndef {macro}\n#define {macro} " in src


def test_without_cupy_it_says_so(monkeypatch, capsys):
    p = _probe()
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert p.main(["--out", "unused"]) == 2
    assert "CuPy" in capsys.readouterr().err
