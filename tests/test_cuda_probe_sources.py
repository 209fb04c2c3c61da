"""The CUDA C probe the scripts compile at run time (scripts/fp8_wgmma_probe.cu, through CuPy's
NVRTC) compiles for sm_90a in every configuration its script builds, on a machine without a GPU:
NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel (a test dependency) turns each one into PTX.
(pdl_preload_probe.cu is a whole program for nvcc, host code and all, so NVRTC cannot take it.)
A probe that does not compile costs a device call to find out. It happened: fp8_wgmma_probe.cu's
`s_prev` was declared for one algorithm and used by another."""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import pytest

from script_loader import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def nvrtc():
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    assert spec is not None, "the nvidia-cuda-nvrtc-cu12 wheel (pyproject's test extras) is not installed"
    lib = ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / "lib" / "libnvrtc.so.12"))

    def compile_ptx(source: str, name: str, defines: dict[str, int]) -> tuple[bool, str, str]:
        """(compiled, NVRTC's log, PTX) of `source` for compute_90a with -D defines."""
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
        # the probes' shared header (probe_cuda.h) found by path, as nvcc finds it beside the source
        opts = [b"--gpu-architecture=compute_90a", b"-std=c++17", f"--include-path={SCRIPTS}".encode()]
        opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode()
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log.value.decode(errors="replace"), ptx

    return compile_ptx


def _fp8_wgmma_configs(probe) -> list[dict[str, int]]:
    """Each distinct structure fp8_wgmma_probe.py compiles: every (algorithm, PIPE, MODE) and every
    DEPTH and KS of its variants, then the bf16 kernel's options (--inblock, --mma, --epi) in each
    MODE."""
    configs, seen = [], set()
    for algo, ks, depth, minb, pipe in probe.VARIANTS:
        for mode in (0, 1, 2):
            key = (algo, pipe, mode, depth, ks)
            if key not in seen:
                seen.add(key)
                configs.append({"ALGO": algo, "KS": ks, "DEPTH": depth, "MINB": minb, "PIPE": pipe, "MODE": mode})
    bf16 = {"ALGO": 2, "KS": 3, "DEPTH": 2, "MINB": 4, "PIPE": 1}
    for extra in ({"INBLK": 1}, {"INBLK": 2}, {"MMA": 1}, {"MMA": 1, "INBLK": 1}, {"EPI": 1}, {"EPI": 2, "MMA": 1}):
        configs += [{**bf16, "MODE": mode, **extra} for mode in (0, 1, 2)]
    return configs


def test_fp8_wgmma_probe_compiles_in_every_configuration(nvrtc):
    probe = load_script("scripts/fp8_wgmma_probe.py", "fp8_wgmma_probe")
    source = (SCRIPTS / "fp8_wgmma_probe.cu").read_text()
    failed = []
    for defines in _fp8_wgmma_configs(probe):
        ok, log, ptx = nvrtc(source, "fp8_wgmma_probe.cu", defines)
        if not ok:
            failed.append(f"{defines}: {log.strip()[:400]}")
            continue
        # the kernels the script launches, for sm_90a; wgmma where the configuration uses it
        assert ".target sm_90a" in ptx and ".entry expert_matvec" in ptx and ".entry bf16_matvec" in ptx
        body = ptx[ptx.index(".entry bf16_matvec") :]
        if defines["ALGO"] == 2 and defines["MODE"] != 1:
            assert ("mma.sync.aligned.m16n8k16" in body) == bool(defines.get("MMA"))
            assert ("wgmma.mma_async" in body) != bool(defines.get("MMA"))
            assert ("atom.global.add.u32" in body) == bool(defines.get("EPI")), defines
    assert not failed, "\n".join(failed)


def test_a_compile_error_is_reported(nvrtc):
    ok, log, _ = nvrtc('extern "C" __global__ void k(float* p) { p[0] = undefined_name; }', "bad.cu", {})
    assert not ok and "undefined_name" in log


def test_mma_subnormal_probe_compiles_for_both_operand_types(nvrtc):
    source = (SCRIPTS / "mma_subnormal_probe.cu").read_text()
    for f16, operand in ((0, "bf16"), (1, "f16")):
        ok, log, ptx = nvrtc(source, "mma_subnormal_probe.cu", {"F16": f16})
        assert ok, log
        assert ".entry mma_probe" in ptx and f"mma.sync.aligned.m16n8k16.row.col.f32.{operand}.{operand}.f32" in ptx


def test_mma_subnormal_probe_cases_tell_exact_from_flushed():
    """The probe's host side: the placed bits decode to the e2m1 values (0.5 on a subnormal), and
    every case's exact product differs from the flush model, so the GPU's answer can tell them apart."""
    import numpy as np

    probe = load_script("scripts/mma_subnormal_probe.py", "mma_subnormal_probe")
    codes = np.arange(16)
    bf16 = probe.placed_values(probe.placed_bits(codes, "bf16"), "bf16")
    f16 = probe.placed_values(probe.placed_bits(codes, "f16"), "f16")
    assert np.array_equal(bf16 * 2.0**126, probe.E2M1) and np.array_equal(f16 * 2.0**14, probe.E2M1)
    one = np.array([1])
    assert probe.placed_bits(one, "bf16")[0] == 0x0040 and probe.placed_bits(one, "f16")[0] == 0x0200
    rng = np.random.default_rng(0)
    for _, kind, a_pow, b_pow in probe.CASES:
        a_bits, b_bits, exact, flushed = probe.make_case(rng, kind, a_pow, b_pow)
        assert a_bits.shape == (16, 16) and b_bits.shape == (16, 8) and a_bits.dtype == np.uint16
        assert not np.array_equal(exact, flushed)


def test_pdl_prewait_probe_kernels_compile(nvrtc):
    """pdl_prewait_probe.cu's kernels (its host part is left out under NVRTC): each stand-in waits
    for the previous grid, then lets the next one launch; only the down stand-in has a path that
    loads before its wait."""
    ok, log, ptx = nvrtc((SCRIPTS / "pdl_prewait_probe.cu").read_text(), "pdl_prewait_probe.cu", {})
    assert ok, log
    bodies = {}
    for name in ("k_stream1", "k_stream2", "k_head"):
        start = re.search(rf"\.entry _Z\d+{name}", ptx).start()  # C++ names, mangled
        end = ptx.find(".entry", start + 1)
        bodies[name] = ptx[start : end if end > 0 else len(ptx)]
    for name, body in bodies.items():
        wait = body.index("griddepcontrol.wait")
        assert wait < body.index("griddepcontrol.launch_dependents"), name
        if name != "k_stream2":
            assert wait < body.index("ld.global"), name
    down = bodies["k_stream2"]
    assert down.count("griddepcontrol.wait") == 2 and down.index("ld.global.nc") < down.rindex("griddepcontrol.wait")


def test_pdl_prewait_probe_table_compares_each_pre_wait_row_with_its_twin():
    probe = load_script("scripts/pdl_prewait_probe.py", "pdl_prewait_probe")
    row = {"head": 1, "graph": 1, "pdl": 1, "min_us": 0.0, "max_us": 99.0}
    result = {
        "device": "GPU",
        "layers": 24,
        "rows": [{**row, "pre": 0, "us_per_layer": 40.0}, {**row, "pre": 1, "us_per_layer": 55.5}],
    }
    lines = probe.table(result).splitlines()
    assert lines[-2].split()[-2:] == ["40.00", "0.00-99.00"] and lines[-1].rstrip().endswith("+15.50")


def test_pdl_prewait_probe_table_compares_mask_and_late_rows_with_pdl_everywhere():
    probe = load_script("scripts/pdl_prewait_probe.py", "pdl_prewait_probe")
    row = {"graph": 1, "pre": 0, "min_us": 0.0, "max_us": 99.0}
    rows = [
        {**row, "head": 1, "pdl": 1, "mask": 7, "late": 0, "us_per_layer": 27.0},
        {**row, "head": 1, "pdl": 1, "mask": 5, "late": 0, "us_per_layer": 25.5},
        {**row, "head": 1, "pdl": 1, "mask": 7, "late": 1, "us_per_layer": 28.0},
        {**row, "head": 0, "pdl": 1, "mask": 3, "late": 0, "us_per_layer": 23.0},
        {**row, "head": 0, "pdl": 0, "mask": 0, "late": 0, "us_per_layer": 18.0},
        {**row, "head": 0, "pdl": 1, "mask": 1, "late": 0, "us_per_layer": 19.0},
    ]
    lines = probe.table({"device": "GPU", "layers": 24, "rows": rows}).splitlines()[2:]
    assert [ln.split()[2] for ln in lines] == ["on", "m5", "on", "on", "off", "m1"]
    assert lines[1].endswith("-1.50") and lines[2].endswith("+1.00") and lines[5].endswith("-4.00")
    assert lines[0].split()[-1] == "0.00-99.00" and lines[4].split()[-1] == "0.00-99.00"


def test_pdl_prewait_probe_soak_summary_counts_the_slow_replays():
    probe = load_script("scripts/pdl_prewait_probe.py", "pdl_prewait_probe")
    us = [27.0] * 80 + [35.0] * 20  # a fifth of the replays in a mode 30 % slower
    s = probe.soak_summary(us)
    assert s["p10"] == 27.0 and s["p50"] == 27.0 and s["p90"] == 35.0 and s["max"] == 35.0
    assert s["replays"] == 100 and s["slow_share"] == pytest.approx(0.2)
    assert probe.soak_summary([27.0, 27.5, 28.0])["slow_share"] == 0.0


def test_pdl_prewait_probe_host_code_compiles(tmp_path):
    """The probe's host part (launches with the PDL attribute, stream capture, graph replay) against
    the CUDA runtime's headers (the nvidia-cuda-runtime-cu12 and -nvcc-cu12 wheels, test dependencies), by g++ with
    the kernels as declarations: nvcc itself is only on the GPU machine."""
    import shutil
    import subprocess

    includes = []
    for wheel in ("cuda_runtime", "cuda_nvcc"):  # the runtime's headers include nvcc's crt/
        spec = importlib.util.find_spec(f"nvidia.{wheel}")
        assert spec is not None, f"the nvidia-{wheel.replace('_', '-')}-cu12 wheel (pyproject's test extras) is missing"
        includes.append(f"-I{Path(next(iter(spec.submodule_search_locations))) / 'include'}")
    gxx = shutil.which("g++")
    assert gxx, "g++ is needed (.ci/run installs it)"
    src = tmp_path / "host.cpp"
    src.write_text((SCRIPTS / "pdl_prewait_probe.cu").read_text())
    cmd = [gxx, "-std=c++17", "-fsyntax-only", "-DPROBE_HOST_CHECK", f"-I{SCRIPTS}", *includes, str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    # and it does report an error in that part
    src.write_text(src.read_text().replace("cudaGraphLaunch(exec, s)", "cudaGraphLaunch(exec, s, s)"))
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0
