#!/usr/bin/env python3
"""PTX, registers and SASS of our Mojo GPU kernels, without a GPU.

Takes the kernel package (src/gptoss_max/kernels) as graphs load it, compiles a small Mojo
program that prints `_compile_code[kernel, target=sm_90a]` for each kernel asked for, and
writes one `.ptx` per kernel. With `--ptxas` (from the `nvidia-cuda-nvcc-cu12` wheel) it
also reports registers / spills / shared memory and ptxas' "Potential Performance Loss" notes
(serialized wgmmas among them), and with `--nvdisasm` (from the `triton`
wheel: `pip download --no-deps triton`, then unzip `triton/backends/nvidia/bin/nvdisasm`)
writes the SASS and counts its instructions by opcode.

    python3 scripts/kernel_asm.py --out asm --ptxas PATH/ptxas --nvdisasm PATH/nvdisasm \\
        'moe_gpu.gate_up_kernel[DType.bfloat16, 2, True]' \\
        'attention_gpu.attention_merge_kernel[DType.bfloat16, DType.float32, 64]'

Each kernel is `module.function[parameters]` as Mojo spells it.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
SPEC = re.compile(r"^(\w+)\.(\w+)(\[.*\])?$")


def program(specs: list[str]) -> str:
    """The Mojo main that prints each kernel's PTX, separated by marker lines."""
    imports, prints = [], []
    for i, spec in enumerate(specs):
        m = SPEC.match(spec.replace(" ", ""))
        if not m:
            raise SystemExit(f"not module.function[params]: {spec!r}")
        module, fn, params = m.group(1), m.group(2), m.group(3) or ""
        imports.append(f"from gptoss_kernels.{module} import {fn} as k{i}")
        prints.append(f'    print("//== {spec}")')
        prints.append(f'    print(_compile_code[k{i}{params}, target=get_gpu_target["sm_90a"]()]())')
    head = ["from max.gpu.host import get_gpu_target", "from max.gpu.host.compile import _compile_code", *imports]
    return "\n".join([*head, "", "", "def main() raises:", *prints]) + "\n"


def run_program(text: str, work: Path, name: str = "asm_main") -> str:
    """Builds a Mojo main against the kernel package for sm_90 (host code for the CPU, device
    code for nvidia:90) and runs it here, without a GPU; returns its stdout. The package is the
    one graphs load (`kernels_path()`, built once per source hash); mojo runs as MAX configures
    it (`subprocess_run_mojo`), whatever the environment MAX left in this process."""
    from mojo.run import subprocess_run_mojo

    from gptoss_max.kernels import kernels_path

    src = work / f"{name}.mojo"
    src.write_text(text)
    exe = work / name
    r = subprocess_run_mojo(["build", "--target-accelerator=nvidia:90", "-I", str(kernels_path().parent), str(src),
                             "-o", str(exe)], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        raise SystemExit("mojo build failed:\n" + "\n".join(errors or r.stderr.splitlines()[-20:]))
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def build_ptx(specs: list[str], work: Path) -> dict[str, str]:
    """kernel spec -> PTX text (`run_program` of `program(specs)`)."""
    out = run_program(program(specs), work)
    parts = re.split(r"^//== (.*)$", out, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def wheel_ptxas() -> str | None:
    """ptxas of the `nvidia-cuda-nvcc-cu12` wheel (the test extras), if installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ptxas"
    return str(path) if path.is_file() else None


# ptxas -v's notes that it degraded the code, e.g. "(C7512) Potential Performance Loss:
# wgmma.mma_async instructions are serialized due to insufficient register resources": every
# wgmma then waits for the one before it (WARPGROUP.DEPBAR 0), with no other sign in the
# register or spill counts.
PERF_LOSS = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?)(?: for the function| in the function|$)")


def perf_losses(stderr: str) -> list[str]:
    """ptxas' "Potential Performance Loss" notes in its -v output, as "C7512: <what>"."""
    return [f"{m.group(1)}: {m.group(2).strip()}" for m in map(PERF_LOSS.search, stderr.splitlines()) if m]


def ptxas_info(ptx: str, ptxas: str, work: Path) -> dict[str, int]:
    """ptxas -v for sm_90a of one kernel's PTX: registers, spill stores / loads (bytes), stack
    frame (bytes), and perf_losses (how many "Potential Performance Loss" notes, such as
    serialized wgmmas). Raises on a ptxas error."""
    src = work / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(work / "k.cubin")],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError("ptxas failed:\n" + r.stderr[-2000:])
    info = {}
    for key, pattern in (
        ("registers", r"Used (\d+) registers"),
        ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"),
        ("stack", r"(\d+) bytes stack frame"),
    ):
        m = re.search(pattern, r.stderr)
        info[key] = int(m.group(1)) if m else 0
    info["perf_losses"] = len(perf_losses(r.stderr))
    return info


def opcode_counts(sass: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
    return counts


_OPCODE = r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"  # an instruction's opcode, after its predicate if any
_INSTR = re.compile(r"\s*/\*[0-9a-f]+\*/\s+" + _OPCODE)


def _opcode(text: str) -> str:
    """The mnemonic of one instruction's text (its predicate and modifiers dropped: `LDG`, not
    `LDG.E.128` or cp.async's `LDGSTS`), as opcode_counts counts it."""
    m = re.match(_OPCODE, text)
    return m.group(1).split(".")[0] if m else ""


MMA_OPS = ("HMMA", "HGMMA")  # mma.sync, wgmma


class Control(NamedTuple):
    """One SASS instruction's scheduling controls (sm_70 and later: the top 23 bits of its 128-bit
    word). A variable-latency instruction (a load, a shared-memory access) increments scoreboard
    `write` (0-5; None: none) until its result is in its register; an instruction that waits on a
    scoreboard (`wait`, a set) stalls until that scoreboard's count is zero, i.e. until every
    instruction still counted on it has landed, not only the one whose result it reads."""

    text: str
    stall: int
    write: int | None
    read: int | None
    wait: frozenset[int]


_HEX_PAIR = re.compile(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;?\s*/\* 0x([0-9a-f]{16}) \*/\s*\n\s*/\* 0x([0-9a-f]{16}) \*/")


def controls(hex_sass: str) -> list[Control]:
    """The instructions of `nvdisasm -hex` output with their decoded controls, in order (labels
    dropped)."""
    found = []
    for m in _HEX_PAIR.finditer(hex_sass):
        c = int(m.group(3), 16) >> 41
        wr, rd = (c >> 5) & 7, (c >> 8) & 7
        found.append(Control(text=m.group(1).strip().rstrip(";").strip(), stall=c & 15,
                             write=None if wr == 7 else wr, read=None if rd == 7 else rd,
                             wait=frozenset(b for b in range(6) if c >> (11 + b) & 1)))  # fmt: skip
    return found


def load_scoreboards(body: list[Control]) -> tuple[dict[int, int], int]:
    """Of a loop body: how many global loads into registers (LDG; not cp.async's LDGSTS, whose
    data lands in shared memory and is waited for by DEPBAR) count on each scoreboard, and how many of its
    instructions wait on one of those scoreboards. With every load on one scoreboard, a wait for
    one batch's registers is a wait for every batch then in flight: a register ring deeper than
    two batches then keeps nothing in flight at its waits."""
    ldg = collections.Counter(c.write for c in body if _opcode(c.text) == "LDG" and c.write is not None)
    return dict(sorted(ldg.items())), sum(1 for c in body if c.wait & set(ldg))


def load_schedule(body: list[Control], limit: int = 16) -> str:
    """Of a loop body: the order of its global loads (LDG), the waits on their scoreboards and its
    mmas, runs counted: "wait · LDG 6 · HMMA 8 · wait · LDG 6 · HMMA 8" has every batch's next loads
    issued after the wait for its own, so they fly while it is decoded; "LDG 6 · wait · HMMA 8"
    waits for the loads it has just issued too, and decodes with nothing in flight. It is the
    program order, every branch included: a wait on a path that rarely runs is listed like any
    other (the attention kernel's `CALL` to the 64-bit division's slow path waits on the loads,
    but runs only for operands past 2^32)."""
    boards = set(load_scoreboards(body)[0])
    steps: list[str] = []
    for c in body:
        op = _opcode(c.text)
        if c.wait & boards:
            steps.append("wait")
        if op == "LDG" or op in MMA_OPS:
            steps.append(op)
    runs: list[list] = []
    for step in steps:  # consecutive waits are one: nothing was issued between them
        if runs and runs[-1][0] == step:
            runs[-1][1] += 1
        else:
            runs.append([step, 1])
    parts = [step if step == "wait" else f"{step} {n}" for step, n in runs]
    if len(parts) > limit:  # an outer loop, nested loops and all
        return " · ".join(parts[:limit]) + f" · … ({len(parts)} steps)"
    return " · ".join(parts)


def _loop_bodies(sass: str, needs: tuple[str, ...], with_next: bool = False) -> list[tuple[str, str]]:
    """Each backward branch's loop (label .. branch) whose body holds one of the `needs` opcodes: its
    label and its instruction lines (each with the line after it, with_next: `nvdisasm -hex`'s
    second word)."""
    body: list[str] = []  # one entry per instruction, labels kept in place
    labels: dict[str, int] = {}
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(body)
        elif _INSTR.match(line):
            body.append(line + "\n" + lines[i + 1] if with_next and i + 1 < len(lines) else line)
    found = []
    for i, line in enumerate(body):
        m = re.search(r"BRA.*\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i + 1) <= i:
            text = "\n".join(body[labels[m.group(1)] : i + 1])
            if any(opcode_counts(text).get(op) for op in needs):
                found.append((m.group(1), text))
    return found


def loops(sass: str, needs: tuple[str, ...] = MMA_OPS) -> list[tuple[str, collections.Counter]]:
    """Each backward branch's loop (label .. branch) whose body holds one of the `needs` opcodes
    (by default a tensor-core op, mma.sync or wgmma): the loop's label and the opcode counts of its
    body (nested loops are reported whole, each)."""
    return [(label, opcode_counts(text)) for label, text in _loop_bodies(sass, needs)]


def wgmma_waits(text: str) -> collections.Counter:
    """How many of the SASS's wgmma waits (`WARPGROUP.DEPBAR.LE gsb0, 0xN`) leave N groups in
    flight, by N. A loop whose waits are all 0 runs its wgmmas one at a time, each waited for
    before the next fragment is decoded: what ptxas does when it serializes them (C7512 / C7515)."""
    depths = re.finditer(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", text)
    return collections.Counter(int(m.group(1), 16) for m in depths)


def loop_wgmma_waits(sass: str) -> list[tuple[str, collections.Counter]]:
    """wgmma_waits of each wgmma loop (loops() with needs HGMMA)."""
    return [(label, wgmma_waits(text)) for label, text in _loop_bodies(sass, ("HGMMA",))]


def control_loops(hex_sass: str, needs: tuple[str, ...] = MMA_OPS) -> list[tuple[str, list[Control]]]:
    """loops() of `nvdisasm -hex` output: each loop's label and its instructions' controls."""
    return [(label, controls(text)) for label, text in _loop_bodies(hex_sass, needs, with_next=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="+",
                    help="module.function[params], e.g. 'moe_gpu.gate_up_kernel[DType.bfloat16, 2, True]'")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="directory for the .ptx (and .cubin, .sass) files")
    ap.add_argument("--ptxas", default=wheel_ptxas(),
                    help="ptxas binary: registers, spills and shared memory per kernel (default: the "
                    "nvidia-cuda-nvcc-cu12 wheel's, from the test extras)")  # fmt: skip
    ap.add_argument("--nvdisasm", help="nvdisasm binary (needs --ptxas): SASS and its opcode counts")
    ap.add_argument("--loops", action="store_true",
                    help="with --nvdisasm: also the opcode counts of every mma loop (HMMA, HGMMA)")  # fmt: skip
    ap.add_argument("--controls", action="store_true",
                    help="with --nvdisasm: write each kernel's SASS with its decoded scheduling controls "
                    "(.ctrl.sass: stall, write / read scoreboard, waits) and, with --loops, the "
                    "scoreboards each mma loop's global loads count on")  # fmt: skip
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = build_ptx(args.kernels, Path(tmp))
    for i, (spec, text) in enumerate(ptx.items()):
        stem = args.out / f"k{i}_{re.sub(r'[^A-Za-z0-9]+', '_', spec).strip('_')}"
        stem.with_suffix(".ptx").write_text(text)
        print(f"{spec}: {stem.with_suffix('.ptx')}")
        if not args.ptxas:
            continue
        r = subprocess.run([args.ptxas, "-arch=sm_90a", "-v", str(stem.with_suffix(".ptx")), "-o",
                            str(stem.with_suffix(".cubin"))], capture_output=True, text=True)  # fmt: skip
        for line in r.stderr.splitlines():
            if "registers" in line or "spill" in line or "error" in line:
                print("   ", line.strip())
        for note in perf_losses(r.stderr):
            print("    ptxas performance loss", note)
        if args.nvdisasm and r.returncode == 0:
            sass = subprocess.run([args.nvdisasm, "-c", str(stem.with_suffix(".cubin"))], capture_output=True,
                                  text=True).stdout  # fmt: skip
            stem.with_suffix(".sass").write_text(sass)
            top = ", ".join(f"{op} {n}" for op, n in opcode_counts(sass).most_common(12))
            print(f"    SASS {sum(opcode_counts(sass).values())} instructions: {top}")
            if args.loops:
                waits = dict(loop_wgmma_waits(sass))
                for label, counts in loops(sass):
                    top = ", ".join(f"{op} {n}" for op, n in counts.most_common(10))
                    mmas = ", ".join(f"{op} {counts[op]}" for op in MMA_OPS if counts[op])
                    depth = ""
                    if waits.get(label):
                        by_depth = sorted(waits[label].items())
                        depth = "; wgmma waits " + ", ".join(f"{n} x {d} in flight" for d, n in by_depth)
                    print(f"    loop {label}: {sum(counts.values())} instructions, {mmas}{depth}: {top}")
            if args.controls:
                hex_sass = subprocess.run([args.nvdisasm, "-c", "-hex", str(stem.with_suffix(".cubin"))],
                                          capture_output=True, text=True).stdout  # fmt: skip
                stem.with_suffix(".ctrl.sass").write_text("".join(f"{_control_line(c)}\n" for c in controls(hex_sass)))
                if args.loops:
                    for label, body in control_loops(hex_sass):
                        per_board, waits = load_scoreboards(body)
                        held = ", ".join(f"SB{b}: {n}" for b, n in per_board.items()) or "none"
                        print(f"    loop {label}: global loads by scoreboard {held}; {waits} waits on those")
                        print(f"    loop {label} schedule: {load_schedule(body)}")
    return 0


def _control_line(c: Control) -> str:
    wait = "".join(str(b) for b in sorted(c.wait))
    write = "" if c.write is None else f"W{c.write}"
    read = "" if c.read is None else f"R{c.read}"
    return f"s{c.stall:<2} {write:3} {read:3} wait[{wait:6}] {c.text}"


if __name__ == "__main__":
    sys.exit(main())
