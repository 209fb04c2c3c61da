"""Every environment variable the project reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


def cache_dir() -> Path:
    """Derived files (tokenizer data, built kernels): `GPTOSS_MAX_CACHE`."""
    xdg = _env_path("XDG_CACHE_HOME", Path.home() / ".cache")
    return _env_path("GPTOSS_MAX_CACHE", xdg / "gptoss-max")


def data_dir() -> Path:
    """Persistent state (the response store, the tiny model): `GPTOSS_MAX_DATA`."""
    return _env_path("GPTOSS_MAX_DATA", Path.home() / ".local" / "share" / "gptoss-max")


def api_key() -> str | None:
    """Optional bearer key required by the server: `GPTOSS_MAX_API_KEY`."""
    return os.environ.get("GPTOSS_MAX_API_KEY") or None


def _choice(name: str, auto: str, *choices: str) -> str:
    """The setting `name`: `auto` (the default, read as `auto`'s value) or one of `choices`."""
    value = os.environ.get(name, "auto")
    if value not in ("auto", *choices):
        raise ValueError(f"{name} must be {', '.join(['auto', *choices[:-1]])} or {choices[-1]}, not {value!r}")
    return auto if value == "auto" else value


def deterministic() -> bool:
    """`GPTOSS_MAX_DETERMINISTIC`: `auto` (= `off`), `off` or `on`. `on` is for bit-repeatable GPU
    runs (`temperature: 0` giving the same tokens every time), at a speed cost (H200, synthetic 20b:
    batch 1 119 tok/s against 186 without it and without graph capture, 575 with capture):
    MAX's `device_sync_mode` (every device op waits for the one before it; `export_device_sync`)
    and our attention for every step. Graph capture is
    refused with it. Read in the process that builds the model (`serve --deterministic` sets it
    for the worker).

    Why (H200, bench/NOTES.md "Greedy repeatability, fifth session"): without it, prompt passes
    of synthetic 20b give other logits from the same tokens. With `device_sync_mode` and our
    attention (capture off) 6 of 6 passes, two teacher-forced passes and three greedy runs were
    bitwise equal; so something races between device ops (not our kernels' PDL trigger:
    removing it changed nothing). MAX's flash attention, which `hybrid` gives prompt steps, also
    reads KV slots and memory that the run did not write, so it is not used.
    """
    return _choice("GPTOSS_MAX_DETERMINISTIC", "off", "off", "on") == "on"


# MAX's debug switch for `device_sync_mode`, parsed once, when `max.engine` is imported (a fresh
# process checks it in test_deterministic.py). A touchpoint with MAX kept here, not in maxapi, since it
# must act before MAX is imported. Setting `InferenceSession.debug.device_sync_mode` later, where the
# model is built, did not make an H200 run repeat (bench/NOTES.md, "Greedy repeatability, sixth session").
MODULAR_DEBUG_ENV = "MODULAR_DEBUG"
DEVICE_SYNC_DEBUG = "device-sync-mode"


def export_device_sync() -> None:
    """Under `GPTOSS_MAX_DETERMINISTIC=on`, add `device-sync-mode` to `MODULAR_DEBUG` in this
    process's environment, so that MAX, imported after it here or in a worker process started
    later, runs every device op after the one before. Called when the package is imported (before
    any MAX import of ours) and by the CLI's `--deterministic`; nothing when the setting is off."""
    if not deterministic():
        return
    flags = [f for f in os.environ.get(MODULAR_DEBUG_ENV, "").split(",") if f]
    if DEVICE_SYNC_DEBUG not in flags:
        os.environ[MODULAR_DEBUG_ENV] = ",".join([*flags, DEVICE_SYNC_DEBUG])


def check_deterministic(graph_capture: bool) -> None:
    """ValueError for what `GPTOSS_MAX_DETERMINISTIC=on` cannot run with: graph capture, or an
    explicit `GPTOSS_MAX_ATTENTION` other than `ours` (attention_impl); nothing when it is off."""
    if not deterministic():
        return
    if graph_capture:
        raise ValueError(
            "GPTOSS_MAX_DETERMINISTIC=on (--deterministic) waits for every device op, which a captured "
            "device graph cannot: drop --graph-capture or --deterministic"
        )
    attention_impl()


def attention_impl() -> str:
    """`GPTOSS_MAX_ATTENTION`: `auto` (= `hybrid`), `hybrid`, `ours` or `max`; what a GPU graph's
    attention core is (a CPU graph always uses ours: MAX's over-counts sinks past 128 keys and
    rejects windows < 256). Read in the process that builds the graph.

    `ours`: our sink-attention op for every step. `max`: MAX's flash_attention_ragged for every
    step; MAX 26.7's GPU decode path disagrees with the reference (docs/GPU.md). `hybrid`: MAX's
    for steps that hold a prompt chunk (its prefill path agrees with the reference and uses tensor
    cores), ours for pure decode steps; chosen in the graph from the step's max prompt length.
    `auto` is `ours` under `GPTOSS_MAX_DETERMINISTIC=on`, which refuses `hybrid` and `max`.
    """
    impl = _choice("GPTOSS_MAX_ATTENTION", "auto", "hybrid", "ours", "max")
    if deterministic():
        if impl not in ("auto", "ours"):
            raise ValueError(
                f"GPTOSS_MAX_DETERMINISTIC=on runs our attention for every step; GPTOSS_MAX_ATTENTION={impl} "
                "would give prompt steps to MAX's flash attention, which reads memory the run did not write"
            )
        return "ours"
    return "hybrid" if impl == "auto" else impl


def moe_path() -> int:
    """`GPTOSS_MAX_MOE_PATH`: which GPU kernel the MXFP4 experts use, `auto` (by routed pairs per
    expert: the decode kernel or the prefill grouped GEMM), `decode` or `prefill` (its default
    tile config). Read in the process that builds the graph; a CPU graph ignores it."""
    from gptoss_max.kernels import ops

    value = os.environ.get("GPTOSS_MAX_MOE_PATH", "auto")
    paths = {"auto": ops.PATH_AUTO, "decode": ops.PATH_DECODE, "prefill": ops.path_prefill(0)}
    if value not in paths:
        raise ValueError(f"GPTOSS_MAX_MOE_PATH must be auto, decode or prefill, not {value!r}")
    return paths[value]


def router_impl() -> str:
    """`GPTOSS_MAX_ROUTER`: `auto` (= `fused`), `fused` or `max`; how a bf16 graph runs the head of
    each MoE block (the residual add after attention, the post-attention RMS norm and the router's
    logits). `fused`: our op (kernels/router_decode.mojo: one launch up to 4 tokens, our add + norm
    and tensor-core router past that) for steps of at most `arch.moe.ROUTER_HEAD_MAX_TOKENS`
    tokens, MAX's add + rms_norm + Linear for larger ones, chosen in
    the graph from the step's token count. `max`: MAX's ops for every step. Read in the process
    that builds the graph; a float32 graph always uses MAX's."""
    return _choice("GPTOSS_MAX_ROUTER", "fused", "fused", "max")


def topk_impl() -> str:
    """`GPTOSS_MAX_TOPK`: `auto` (= `experts`), `experts` or `op`; where an MXFP4 MoE block takes the
    router's top-k. `experts`: inside the experts' first op (gptoss_moe_route_gate_up_mxfp4), which
    on the GPU needs no launch of its own for a one-token step. `op`: our top-k op before the
    experts. Same values either way. Read in the process that builds the graph."""
    return _choice("GPTOSS_MAX_TOPK", "experts", "experts", "op")


def rope_impl() -> str:
    """`GPTOSS_MAX_ROPE`: `auto` (= `fused`), `fused` or `max`; where a step that runs our attention op
    applies RoPE and stores its K/V. `fused`: inside our op (gptoss_attention_rope_sinks), which on
    the GPU is one launch for a pure decode step of at most 16 tokens. `max`: MAX's rope_split_store_ragged before our
    op. Steps given to MAX's attention (`GPTOSS_MAX_ATTENTION`) always use MAX's. Same values either
    way up to f32 rounding order. Read in the process that builds the graph."""
    return _choice("GPTOSS_MAX_ROPE", "fused", "fused", "max")


def dense_impl() -> str:
    """`GPTOSS_MAX_DENSE`: `auto` (= `tc`), `tc`, `tc1` or `max`; how a bf16 graph runs the dense
    projections of attention (qkv, o_proj) and the router's logits. `tc`: our tensor-core op
    (kernels/gemv.mojo) for steps of `arch.dense.DENSE_MIN_TOKENS`..`DENSE_MAX_TOKENS` tokens, MAX's
    Linear for the others, chosen in the graph from the step's token count. `tc1`: the same from
    one token (one-token steps then skip MAX's split-K GEMV, which is faster there: for checks).
    `max`: MAX's Linear for every step. Same values up to f32 summation order. Read in the process
    that builds the graph; a float32 graph always uses MAX's."""
    return _choice("GPTOSS_MAX_DENSE", "tc", "tc", "tc1", "max")


def qkv_head_impl() -> str:
    """`GPTOSS_MAX_QKV_HEAD`: `auto` (= `fused`), `fused` or `max`; how a bf16 graph runs the head of
    each attention block after the first (the previous layer's residual add, the input RMS norm
    and the qkv projection). `fused`: our op (kernels/router_decode.mojo, the MoE head's) for steps
    of at most `arch.attention.QKV_HEAD_MAX_TOKENS` tokens (one launch up to 4 tokens, the norm and
    our tensor-core projection past that), MAX's add + rms_norm + Linear for larger ones, chosen
    in the graph from the step's token count. `max`: MAX's ops for every step (qkv then through
    `GPTOSS_MAX_DENSE`'s choice). Needs our attention (`GPTOSS_MAX_ATTENTION` not `max`). Same values
    up to f32 summation order. Read in the process that builds the graph; a float32 graph always
    uses MAX's."""
    return _choice("GPTOSS_MAX_QKV_HEAD", "fused", "fused", "max")


def tap_mode() -> str:
    """`GPTOSS_MAX_TAP`: `auto` (= `off`), `off`, `on` or `weights`; a check: `on` puts `gptoss_tap` (an
    identity op that prints a hash of its input's bits at each run, kernels/tap.mojo) on each
    layer's qkv, attention output, MoE input, router logits and MoE output, so two runs of a step
    can be compared layer by layer (scripts/gpu_repeat.py, a variant with `GPTOSS_MAX_TAP=on`).
    `weights`: also the residual stream entering each MoE block, and every dense projection that
    goes through `arch.dense.project` runs as MAX's matmul on its weight and bias passed through a
    tap, so a weight whose bits change between steps (a stray write) shows as a changed hash. Read
    in the process that builds the graph."""
    return _choice("GPTOSS_MAX_TAP", "off", "off", "on", "weights")


def tap_enabled() -> bool:
    """`GPTOSS_MAX_TAP` is `on` or `weights` (tap_mode)."""
    return tap_mode() != "off"


def tap_weights() -> bool:
    """`GPTOSS_MAX_TAP=weights` (tap_mode)."""
    return tap_mode() == "weights"


REPLAY_MODES = ("off", "on", "check")  # --replay-small-graphs (bench, serve): maxapi.replay_in_mode
REPLAYABLE_GRAPHS = ("sampler", "sampler_bitmask", "realize_future_token")
# The scatter is left out: replayed without the samplers it crashed the server's worker on an H200
# (a token id out of range reached the embedding; bench/NOTES.md, "Sixteenth session"). Asked for, it
# replays only on tokens a replayed sampler wrote (maxapi.replay_overlap_graphs), the one way it passed.
DEFAULT_REPLAY_GRAPHS = ("sampler", "sampler_bitmask")


def replay_graphs() -> tuple[str, ...]:
    """`GPTOSS_MAX_REPLAY_GRAPHS`: which of the overlap pipeline's small per-step graphs
    `--replay-small-graphs` replays, comma-separated from `sampler`, `sampler_bitmask` (the sampler
    with a token bitmask, under structured output) and `realize_future_token` (the scatter of the
    previous step's token, unsafe in serving: DEFAULT_REPLAY_GRAPHS); the samplers when unset, `all`
    for the three."""
    raw = os.environ.get("GPTOSS_MAX_REPLAY_GRAPHS", "").strip()
    if not raw:
        return DEFAULT_REPLAY_GRAPHS
    if raw == "all":
        return REPLAYABLE_GRAPHS
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in REPLAYABLE_GRAPHS]
    if unknown:
        raise ValueError(f"GPTOSS_MAX_REPLAY_GRAPHS names {unknown}; choose from {', '.join(REPLAYABLE_GRAPHS)}")
    return names


# The settings above that change what the model computes or how fast (data paths and keys do not).
RUN_SETTINGS = (
    "GPTOSS_MAX_ATTENTION",
    "GPTOSS_MAX_DENSE",
    "GPTOSS_MAX_DETERMINISTIC",
    "GPTOSS_MAX_MOE_PATH",
    "GPTOSS_MAX_QKV_HEAD",
    "GPTOSS_MAX_REPLAY_GRAPHS",
    "GPTOSS_MAX_ROPE",
    "GPTOSS_MAX_ROUTER",
    "GPTOSS_MAX_TOPK",
)


def run_setting_env() -> list[str]:
    """`NAME=value` for each run-changing setting set in this process: a benchmark command's prefix."""
    return [f"{k}={os.environ[k]}" for k in RUN_SETTINGS if os.environ.get(k)]
