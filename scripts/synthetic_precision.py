"""How sensitive a synthetic gpt-oss is to rounding, on the CPU (issue 9): transformers'
GptOssForCausalLM on the synthetic weights, run in float64, float32 and bfloat16 over the same
teacher-forced tokens; float32 and bf16 compared with float64.

    python3 scripts/synthetic_precision.py --hidden 768 --layers 24 [--qk-std 2.3 --embed-std 1]

A reduced width (`--hidden`, heads scaled with it; vocab, 32 experts, top-4 and every std per
fan-in as the 20b) fits a 24-layer float64 run in a few GB. Per precision: logits cos min / mean
and argmax agreement (`fidelity.compare`), per layer the fraction of tokens whose top-4 expert set
differs from float64's, and the median |router logit error|; plus float64's gap between the 4th
and 5th router logit. `--qk-std` / `--embed-std` override the generator's q/k weight std
(x sqrt(hidden)) and embedding std, e.g. 2.3 / 1 for generator 2. With `--out`, writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np


def sensitivity(hidden: int, layers: int, tokens: int, seed: int = 0, qk_std: float | None = None,
                embed_std: float | None = None, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:  # fmt: skip
    from unittest import mock

    from gptoss_max import synthetic
    from gptoss_max.config import PRESETS, ModelSpec
    from gptoss_max.fidelity import precision_sensitivity, synthetic_reference

    spec = PRESETS["20b"].with_(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=max(1, hidden // 48), num_key_value_heads=max(1, hidden // 384),
                                layer_types=())  # fmt: skip

    class Reduced(synthetic.SyntheticModel):
        @property
        def spec(self) -> ModelSpec:
            return spec

    overrides = {k: v for k, v in [("QK_STD", qk_std), ("EMBED_STD", embed_std)] if v is not None}
    with mock.patch.multiple(synthetic, **overrides) if overrides else contextlib.nullcontext():
        ref = synthetic_reference(Reduced("20b", seed=seed))
        stds = {"qk_std": synthetic.QK_STD, "embed_std": synthetic.EMBED_STD}
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 199_990, size=tokens)]
    out = precision_sensitivity(ref, ids, dtypes)
    out["model"] = {"hidden": hidden, "heads": spec.num_attention_heads, "kv_heads": spec.num_key_value_heads,
                    "layers": layers, "experts": spec.num_local_experts, "tokens": tokens, "seed": seed,
                    **stds, "generator": synthetic.GENERATOR if not overrides else "overridden"}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768, help="hidden = intermediate size (multiple of 48 and 32)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=400, help="tokens (the GPU check: 150 + 250)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qk-std", type=float, help="q/k weight std x sqrt(hidden) (generator 2: 2.3)")
    ap.add_argument("--embed-std", type=float, help="embedding std (generator 2: 1.0)")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    res = sensitivity(args.hidden, args.layers, args.tokens, args.seed, args.qk_std, args.embed_std)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res["model"]))
    print(f"float64 router: logit std {res['router_logit_std']:.2f}, 4th-5th gap median {res['gap_median']:.3f}, "
          f"gap < 0.01 for {res['gap_below_0.01']:.1%} of tokens")  # fmt: skip
    for dtype, row in res["rows"].items():
        print(f"{dtype:9s} vs float64: cos min {row['cos_min']:.6f} mean {row['cos_mean']:.6f} "
              f"argmax {row['argmax_agree_clear']:.4f} over {row['clear_steps']} steps")  # fmt: skip
        print("  top-4 changed per layer: " + " ".join(f"{x:.3f}" for x in row["route_changes"]))
        print("  |router logit err| median per layer: " + " ".join(f"{x:.1e}" for x in row["router_err_median"]))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    print(f"{res['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
