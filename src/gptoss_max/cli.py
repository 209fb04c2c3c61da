"""`gptoss-max`: make-tiny, make-checkpoint, generate, serve, bench.

Every `--model` also takes `synthetic:<tiny|20b|120b>[,seed=N][,experts=mxfp4|bf16][,layers=N]`:
the real config with random weights made in memory (no weight files)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from gptoss_max import settings

DEFAULT_GPU_MODEL = "openai/gpt-oss-20b"


MODEL_HELP = "local dir, HF id, synthetic:<tiny|20b|120b>[,seed=N][,experts=mxfp4|bf16][,layers=N], or auto"


def resolve_model(model: str, on_gpu: bool) -> str:
    """`auto`: the 20b on a GPU; without one, a tiny random model built once under the data dir.
    `synthetic:...`: its directory (config, tokenizer, header-only stub), made once."""
    if model.startswith("synthetic:"):
        from gptoss_max.synthetic import resolve

        return resolve(model)
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


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from gptoss_max.synthetic import SyntheticModel, write_checkpoint

    model = SyntheticModel.parse(args.config)
    if args.seed is not None or args.experts or args.layers:
        model = SyntheticModel(model.preset, args.seed if args.seed is not None else model.seed,
                               args.experts or model.experts, args.layers or model.layers)  # fmt: skip
    t0 = time.perf_counter()
    out = write_checkpoint(Path(args.dir), model.spec, model.seed, model.mxfp4_experts,
                           shard_bytes=int(args.shard_gb * 1e9), threads=args.threads, progress=True)  # fmt: skip
    size = model.weights_bytes()
    print(f"wrote {model.name} ({size / 1e9:.2f} GB of weights) to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from gptoss_max.e2e import run

    return run(args)


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


def cmd_prune_store(args: argparse.Namespace) -> int:
    from gptoss_max.server.store import open_store

    if args.older_than < 0:
        sys.exit("prune-store: --older-than must be at least 0 days")
    store = open_store(args.store)
    try:
        n = store.prune(time.time() - args.older_than * 86400)
    finally:
        store.close()
    print(f"deleted {n} stored responses older than {args.older_than:g} days from {store.location}")
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

    p = sub.add_parser(
        "make-checkpoint",
        help="write a synthetic gpt-oss checkpoint (HF layout, sharded safetensors) of a preset's real size",
    )
    p.add_argument("dir")
    p.add_argument("--config", default="20b", help="tiny | 20b | 120b, or synthetic:<preset>[,seed=N][,...]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--experts", choices=["mxfp4", "bf16"], default=None, help="default mxfp4")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    p.add_argument("--shard-gb", type=float, default=5.0, help="safetensors shard size")
    p.add_argument("--threads", type=int, default=None, help="generator threads (default: all cores)")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("generate", help="render a Harmony prompt, generate, print the parsed channels")
    p.add_argument("--model", default="auto", help=MODEL_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default="medium")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    add_deterministic_argument(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "prune-store",
        help="delete stored responses older than some days (a conversation's newer turns stay whole)",
        description="Deletes what DELETE /v1/responses/{id} would, for every stored response created "
        "more than --older-than days ago; one that a newer response continues is kept hidden for it. "
        "Safe to run (e.g. daily from cron) while servers use the store.",
    )
    p.add_argument("--older-than", type=float, required=True, metavar="DAYS")
    p.add_argument("--store", default=None, metavar="PATH_OR_URL",
                   help="as serve's --store: a SQLite file (default: in the data dir) or a "
                        "postgresql:// URL")  # fmt: skip
    p.set_defaults(func=cmd_prune_store)

    from gptoss_max.e2e import add_arguments

    p = add_arguments(
        sub.add_parser(
            "bench",
            help="end-to-end decode tok/s, TTFT, TPOT, peak memory: ours, MAX's stock gpt_oss, roofline",
            description="See `python -m gptoss_max.e2e --help` for how each figure is measured.",
        )
    )
    p.set_defaults(func=cmd_bench)

    try:
        from gptoss_max.server.cli import add_serve_parser
    except ImportError as exc:  # the server package is optional for the other commands
        p = sub.add_parser("serve", help="(unavailable) the Responses API server")
        p.set_defaults(func=lambda _a, exc=exc: sys.exit(f"serve is unavailable: {exc}"))
    else:
        add_serve_parser(sub)
    return parser


def add_deterministic_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="GPU: bit-repeatable runs, so temperature 0 repeats its tokens (sets "
                        "GPTOSS_MAX_DETERMINISTIC=on: MAX's device_sync_mode and our attention for every "
                        "step; slower, no graph capture; docs/GPU.md)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "deterministic", False):
        os.environ["GPTOSS_MAX_DETERMINISTIC"] = "on"  # read where the model is built (the server's worker too)
        settings.export_device_sync()  # MAX is not imported yet: MODULAR_DEBUG still counts
        try:  # before anything loads: what engine.pipeline_args would refuse later
            settings.check_deterministic(getattr(args, "graph_capture", "off") in (True, "on"))  # auto: off
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
