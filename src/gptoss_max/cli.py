"""`gptoss-max`: make-tiny, generate, serve."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from gptoss_max import settings

DEFAULT_GPU_MODEL = "openai/gpt-oss-20b"


def resolve_model(model: str, on_gpu: bool) -> str:
    """`auto`: the 20b on a GPU; without one, a tiny random model built once under the data dir."""
    if model != "auto":
        return model
    if on_gpu:
        return DEFAULT_GPU_MODEL
    tiny = settings.data_dir() / "tiny-mxfp4"
    if not (tiny / "model.safetensors").exists():
        print(f"No GPU found: building a tiny random gpt-oss checkpoint at {tiny} (not a real model).")
        make_tiny(tiny, "mxfp4", seed=0)
    else:
        print(f"No GPU found: serving the tiny random gpt-oss checkpoint at {tiny} (not a real model).")
    return str(tiny)


def make_tiny(out: Path, experts: str, seed: int) -> Path:
    from gptoss_max.config import PRESETS
    from gptoss_max.synthetic import write_checkpoint

    return write_checkpoint(out, PRESETS["tiny"], seed=seed, mxfp4_experts=experts == "mxfp4")


def cmd_make_tiny(args: argparse.Namespace) -> int:
    out = make_tiny(Path(args.dir), args.experts, args.seed)
    print(f"wrote a tiny gpt-oss checkpoint ({args.experts} experts, seed {args.seed}) to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from openai_harmony import Message, Role

    from gptoss_max.engine import Engine, EngineOptions, uses_gpu
    from gptoss_max.harmony.parse import ItemDone, ItemStarted, parse_completion
    from gptoss_max.harmony.render import TurnSpec, render_prompt

    on_gpu = uses_gpu(args.device)
    model = resolve_model(args.model, on_gpu)
    prompt_ids = render_prompt(
        TurnSpec(effort=args.reasoning_effort), [Message.from_role_and_content(Role.USER, args.prompt)]
    ).ids
    logging.getLogger("max.pipelines").setLevel(logging.INFO)  # MAX reports weights loading and compile times
    print(f"loading and compiling {model} on {'GPU' if on_gpu else 'CPU'} (first compile takes minutes) ...")
    engine = Engine(EngineOptions(model=model, device="gpu" if on_gpu else "cpu", max_batch_size=1))
    print(f"ready in {engine.load_seconds:.1f} s; prompt {len(prompt_ids)} tokens")
    t0 = time.perf_counter()
    first = None
    out: list[int] = []
    for tok in engine.generate(prompt_ids, args.max_new_tokens, temperature=args.temperature):
        first = first or time.perf_counter()
        out.append(tok)
    end = time.perf_counter()
    kind = "?"
    for event in parse_completion(out, truncated=len(out) >= args.max_new_tokens):
        if isinstance(event, ItemStarted):
            kind = f"call {event.name}" if event.kind == "function_call" else (event.phase or event.kind)
        elif isinstance(event, ItemDone):
            print(f"[{kind}] {event.text}")
    decode_s = end - (first or end)
    rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else float("nan")
    print(f"{len(out)} tokens; time to first token {((first or end) - t0) * 1e3:.0f} ms; decode {rate:.1f} tok/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptoss-max", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log MAX's progress")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny random gpt-oss checkpoint in the exact HF layout")
    p.add_argument("dir")
    p.add_argument("--experts", choices=["mxfp4", "bf16"], default="mxfp4")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("generate", help="render a Harmony prompt, generate, print the parsed channels")
    p.add_argument("--model", default="auto", help="local dir, HF id, or auto")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default="medium")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.set_defaults(func=cmd_generate)

    try:
        from gptoss_max.server.cli import add_serve_parser
    except ImportError as exc:  # the server package is optional for the other commands
        p = sub.add_parser("serve", help="(unavailable) the Responses API server")
        p.set_defaults(func=lambda _a, exc=exc: sys.exit(f"serve is unavailable: {exc}"))
    else:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
