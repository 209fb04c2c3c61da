"""`gptoss-max serve`: MAX's serving app and model worker, with our routes mounted.

Mirrors MAX's own `serve_api_server_and_model_worker` (max/_entrypoints/cli/serve/), with
three differences: the model is built by `gptoss_max.engine.pipeline_args` (our custom
architecture), MAX's generic `/v1/responses` stays off (`responses` is kept out of the
API types), and our routes replace MAX's at the paths we serve.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gptoss_max import settings
from gptoss_max.cli import MODEL_HELP, add_deterministic_argument

logger = logging.getLogger("gptoss_max.server")

API_KEY_ENV = "GPTOSS_MAX_API_KEY"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # state.DEFAULT_MAX_BODY_BYTES (not imported: keeps --help light)
DEFAULT_GRACE_S = 25.0  # shutdown.DEFAULT_GRACE_S


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the Responses API and Harmony chat completions on MAX")
    p.add_argument("--model", default="auto", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--devices", default="auto", help="auto, cpu, gpu, or gpu:0,1,...")
    p.add_argument("--max-batch-size", type=int, default=None, help="sequences per batch")
    p.add_argument("--max-length", type=int, default=None, help="context length in tokens")
    p.add_argument("--max-queue-size", type=int, default=None, help="backlog before HTTP 429")
    p.add_argument("--store", default=None, metavar="PATH_OR_URL",
                   help="stored responses: a SQLite file (default: in the data dir) or a postgresql:// URL "
                        "shared by replicas (a password is best given as PGPASSWORD)")  # fmt: skip
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, "
                        "which unlike a flag is not visible in ps)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="larger request bodies are refused (HTTP 413)")  # fmt: skip
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                   help="on SIGTERM, seconds running streams may take to finish before they end as failed")  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model id clients send")
    p.add_argument("--enable-bench", action="store_true", help="turn on GET /bench")
    p.add_argument("--graph-capture", nargs="?", const="on", default="auto", choices=GRAPH_CAPTURE_CHOICES,
                   help="replay decode steps as captured device graphs (MAX's overlap pipeline; captures every "
                        "batch size at start-up). auto (the default): on when serving on a GPU without "
                        "--deterministic, off otherwise; on (also the bare flag) refuses a CPU. Synthetic 20b, "
                        "batch 1, H200: ~186 tok/s without, ~590 with (bench/results/e2e_h200_*)")  # fmt: skip
    p.add_argument("--replay-small-graphs", nargs="?", const="on", default="off", choices=settings.REPLAY_MODES,
                   help="with graph capture: the per-step samplers replay device graphs too (maxapi.ReplayedModel; "
                        "GPTOSS_MAX_REPLAY_GRAPHS adds the token scatter, which crashed the worker on an H200). on "
                        "(also the bare flag); check: and each replay is compared with an eager call, mismatches "
                        "logged (slow). Off by default: on an H200 at batch 1 it did not raise tok/s (577 against "
                        "577; bench/NOTES.md, \"Seventeenth session\")")  # fmt: skip
    p.add_argument("--isolate-scheduler-thread", action="store_true",
                   help="Linux: the model worker's scheduler thread (which runs every step's host work) gets a CPU "
                        "core of its own; the worker's other threads, later ones too, are kept off it. In the e2e "
                        "bench (synthetic 20b, batch 1, H200) isolation took 462 to 510 and 533 to 588 tok/s; "
                        "not yet measured under serving")  # fmt: skip
    add_deterministic_argument(p)
    p.add_argument("--constrained-reasoning-tokens", type=_non_negative, default=None, metavar="N",
                   help="under a response format or tool choice, cap each reasoning message at N tokens")  # fmt: skip
    p.set_defaults(func=serve_main)
    return p


GRAPH_CAPTURE_CHOICES = ("auto", "on", "off")


def graph_capture_wanted(choice: str | bool, on_gpu: bool) -> bool:
    """`serve --graph-capture`: `on` / `off` as given (a bool as on / off), `auto` on a GPU unless
    bit-repeatable runs were asked for (GPTOSS_MAX_DETERMINISTIC=on cannot capture graphs)."""
    if isinstance(choice, bool):
        return choice
    if choice == "auto":
        return on_gpu and not settings.deterministic()
    return choice == "on"


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def pipeline_args(args: argparse.Namespace) -> Any:
    """MAX PipelineArgs for `args`, built like `gptoss-max generate` builds them."""
    from max.pipelines.lib.device_specs import coerce_device_specs_input
    from max.pipelines.modeling.types import PipelineTask

    from gptoss_max.cli import resolve_model
    from gptoss_max.engine import EngineOptions, uses_gpu
    from gptoss_max.engine import pipeline_args as engine_pipeline_args

    device = args.devices if args.devices in ("auto", "cpu", "gpu") else "gpu"
    on_gpu = uses_gpu(device)
    opts: dict[str, Any] = {"model": resolve_model(args.model, on_gpu), "device": device}
    if args.max_length:
        opts["max_length"] = args.max_length
    if args.max_batch_size:
        opts["max_batch_size"] = args.max_batch_size
    opts["graph_capture"] = graph_capture_wanted(getattr(args, "graph_capture", "auto"), on_gpu)
    # refused without graph capture (the worker's ProbedFactory does the wrapping, check mode included)
    opts["replay_small_graphs"] = getattr(args, "replay_small_graphs", "off")
    update: dict[str, Any] = {"task": PipelineTask.TEXT_GENERATION}
    if args.served_model_name:
        update["served_model_name"] = args.served_model_name
    if args.devices not in ("auto", "cpu", "gpu"):
        update["device_specs"] = coerce_device_specs_input(args.devices)
    return engine_pipeline_args(EngineOptions(**opts)).model_copy(update=update)


def serve_settings(args: argparse.Namespace) -> Any:
    """MAX's serving settings: its OpenAI routes (ours replace some), never its /v1/responses."""
    from max.serve.config import APIType, MetricRecordingMethod, Settings

    kw: dict[str, Any] = {
        "MAX_SERVE_HOST": args.host,
        "MAX_SERVE_PORT": args.port,
        "MAX_SERVE_API_TYPES": [APIType.OPENAI],
        "MAX_SERVE_METRIC_RECORDING_METHOD": MetricRecordingMethod.ASYNCIO,
        "MAX_SERVE_LOGS_ENABLE_COMPONENTS": "gptoss_max",  # MAX's log filter drops other loggers
    }
    if args.max_queue_size is not None:
        kw["MAX_SERVE_MAX_QUEUE_SIZE"] = args.max_queue_size
    return Settings(**kw)


def with_constrained_decoding(config: Any) -> Any:
    """The config with MAX's grammar masking on: the worker compiles each request's grammar
    (xgrammar) and the sampler graph takes a token bitmask.

    MAX refuses `enable_structured_output` on CPU at validation only; its CPU sampler applies
    the bitmask (`mo.apply_packed_bitmask`) correctly, which the tiny-model tests check. So the
    flag is set after validation, on every device.
    """
    sampling = config.sampling.model_copy(update={"enable_structured_output": True})
    return config.model_copy(update={"sampling": sampling})


def build_max_app(args: argparse.Namespace, settings: Any) -> tuple[Any, Any]:
    """MAX's app (its model worker starts later, in `lifespan`) with our routes mounted."""
    from max.pipelines import PIPELINE_REGISTRY
    from max.pipelines.lib import PipelineConfig
    from max.serve.api_server import ServingTokenGeneratorSettings, fastapi_app

    from gptoss_max.server.app import mount
    from gptoss_max.server.kv_probe import KVProbe, ProbedFactory, expose
    from gptoss_max.server.max_engine import MaxEngine
    from gptoss_max.server.state import ServerState
    from gptoss_max.server.store import open_store

    config = with_constrained_decoding(PipelineConfig.from_args(pipeline_args(args)))
    retrieved = PIPELINE_REGISTRY.retrieve_factory(config, task=config.task)
    kv_dir = tempfile.mkdtemp(prefix="gptoss-kv-")
    atexit.register(shutil.rmtree, kv_dir, True)
    kv = KVProbe(Path(kv_dir) / "kv.json")
    serving = ServingTokenGeneratorSettings(
        model_factory=ProbedFactory(
            retrieved.factory,
            kv.path,
            replay_small_graphs=args.replay_small_graphs,
            isolate=args.isolate_scheduler_thread,
        ),
        pipeline_config=config,
        tokenizer=retrieved.tokenizer,
        task=config.task,
        memory_plan=retrieved.memory_plan,
    )
    app = fastapi_app(settings, serving)
    engine = MaxEngine(
        app,
        model_name=config.models.model_name,
        max_context=int(retrieved.tokenizer.max_length),
        sampling_defaults=config.model.sampling_params_defaults,
    )
    store = open_store(args.store)
    state = ServerState(engine, store, args.enable_bench, args.constrained_reasoning_tokens,
                        max_body_bytes=args.max_body_bytes, kv=kv)  # fmt: skip
    expose(kv)
    mount(app, state)
    logger.info(
        "serving %s (context %d); responses stored in %s",
        engine.model_name,
        engine.max_context,
        store.location,
    )
    return app, serving


def export_api_key(args: argparse.Namespace) -> None:
    """`--api-key` into the environment, where the server reads the key on each request (as it
    does a key given there in the first place)."""
    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key


def serve_main(args: argparse.Namespace) -> int:
    import uvloop
    from max.serve.api_server import fastapi_config, lifespan, validate_port_is_free
    from max.serve.telemetry.common import configure_logging, configure_metrics
    from sse_starlette.sse import unpatch_uvicorn_signal_handler

    from gptoss_max.server import shutdown

    export_api_key(args)
    validate_port_is_free(args.port)
    settings = serve_settings(args)
    configure_logging(settings)
    configure_metrics(settings)  # as MAX's own entrypoint does; without it each metric logs an error
    app, serving = build_max_app(args, settings)
    server = shutdown.DrainingServer(fastapi_config(app, settings), app.state.gptoss, args.shutdown_grace)
    shutdown.install_exit_handler()
    unpatch_uvicorn_signal_handler()
    uvloop.run(shutdown.serve(server, lifespan(app, settings, serving, app.state.zmq_endpoint_base)))
    return 0
