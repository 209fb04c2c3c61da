"""Our architecture on the GPU vs transformers on the same GPU, teacher-forced (issue: GPU fidelity).

    export PYTHONPATH=<staged MAX site>:$PWD/src PYTHONUNBUFFERED=1
    python3 scripts/gpu_check.py --out $OUT/gpu_check.json [--preset tiny|wide] [--layers 2]

`tiny` is the CI checkpoint (hidden 128); `wide` has real gpt-oss widths (hidden 2880,
64 q / 8 KV heads of 64, intermediate 2880, vocab 201088) with few layers. Window 128,
sinks N(3, 2); the prompt is longer than the window, then decode steps are forced.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gptoss_max.config import PRESETS
from gptoss_max.engine import Engine, EngineOptions
from gptoss_max.fidelity import compare, max_logits, reference_logits
from gptoss_max.synthetic import write_checkpoint


def spec_for(preset: str, layers: int):
    if preset == "tiny":
        return PRESETS["tiny"]
    return PRESETS["20b"].with_(num_hidden_layers=layers, layer_types=())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--forced", type=int, default=90)
    ap.add_argument("--experts", nargs="+", default=["mxfp4", "bf16"])
    ap.add_argument("--encoding", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--attention", choices=["ours", "max", "hybrid"], default="ours", help="sets GPTOSS_MAX_ATTENTION")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ["GPTOSS_MAX_ATTENTION"] = args.attention
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    rows = []
    ids = [int(x) for x in np.random.default_rng(7).integers(0, 199_990, size=args.prompt + args.forced)]
    for experts in args.experts:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_checkpoint(Path(tmp), spec_for(args.preset, args.layers), 1, experts == "mxfp4")
            t0 = time.perf_counter()
            opts = EngineOptions(model=str(model_dir), device="gpu", max_batch_size=1, max_length=2048,
                                 encoding=args.encoding)  # fmt: skip
            engine = Engine(opts)
            compile_s = time.perf_counter() - t0
            ours = max_logits(engine, ids[: args.prompt], ids[args.prompt :])
            del engine
            ref = reference_logits(model_dir, ids, device="cuda")[args.prompt - 1 :]
            # The checkpoint's bf16 noise floor: transformers itself in bf16 against its float32.
            floor = compare(reference_logits(model_dir, ids, device="cuda", dtype="bfloat16")[args.prompt - 1 :], ref)
            print(f"{args.preset} transformers-bf16-vs-fp32 {experts:5s} all     {floor}", flush=True)
            rows.append({"experts": experts, "encoding": "transformers-bfloat16", "part": "all", **floor.as_dict()})
        for part, sl in [("prefill", slice(0, 1)), ("decode", slice(1, None)), ("all", slice(None))]:
            agreement = compare(ours[sl], ref[sl])
            rows.append({"experts": experts, "encoding": args.encoding, "attention": args.attention, "part": part,
                         "compile_s": round(compile_s, 1), **agreement.as_dict()})  # fmt: skip
            print(f"{args.preset} {args.encoding} attn={args.attention} {experts:5s} {part:7s} {agreement}", flush=True)
        result = {
            "device": gpu.stdout.strip(),
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python3", *sys.argv]),
            "preset": args.preset,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2))  # after each kind: a timed-out call keeps the ones done
    return 0


if __name__ == "__main__":
    sys.exit(main())
