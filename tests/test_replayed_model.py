"""maxapi.ReplayedModel: the overlap pipeline's small per-step graphs (sampler, future-token
scatter) replayed from device graphs. A stand-in model checks the bookkeeping (signatures, when it
captures, what each replay refreshes); a real MAX graph checks that replayed results equal eager
ones, call after call with new values (on a CPU, where MAX cannot capture, that the call falls
back to eager and says so; on a GPU, the replay itself)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from gptoss_max import maxapi
from op_graphs import load_op_graph, op_devices


class StandIn:
    """Records captures and replays; each computes x + 1 (`off` added to a replay's result: a
    replay that goes wrong)."""

    def __init__(self, fail_capture: bool = False, off: float = 0.0):
        self.fail_capture = fail_capture
        self.off = off
        self.calls: list[tuple[str, int | None]] = []
        self.captured: dict[int, tuple[list, list]] = {}

    @property
    def signature(self):
        import inspect

        return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in "xk"])

    def execute(self, *inputs):
        self.calls.append(("execute", None))
        return [host(inputs[0].to_numpy() + 1)]

    def capture(self, key, *stable):
        if self.fail_capture:
            raise RuntimeError("not capturable")
        self.calls.append(("capture", key))
        self.captured[key] = (list(stable), [host(np.zeros_like(stable[0].to_numpy()))])
        return self.captured[key][1]

    def replay(self, key, *stable):
        captured, (out,) = self.captured[key]
        assert [id(b) for b in stable] == [id(b) for b in captured]  # the captured buffers
        out.to_numpy()[:] = captured[0].to_numpy() + 1 + self.off
        self.calls.append(("replay", key))


def host(values, dtype=np.float32):
    from max.driver import Buffer

    return Buffer.from_numpy(np.asarray(values, dtype=dtype))


def test_captures_a_signature_on_its_second_call_then_replays_it():
    model = maxapi.ReplayedModel(StandIn(), capture_after=2)
    x, k = host([1.0, 2.0]), host(3, np.int64)
    first = model.execute(x, k)
    assert np.array_equal(first[0].to_numpy(), [2.0, 3.0])
    assert model.counts == {"replay": 0, "capture": 0, "eager": 1}
    (second,) = model(x, k=k)  # the second sighting captures, then replays it
    (third,) = model.execute(host([1.0, 2.0]), host(3, np.int64))  # same signature: a replay
    assert third is second and np.array_equal(third.to_numpy(), [2.0, 3.0])  # the graph's own output
    assert [c for c, _ in model.model.calls] == ["execute", "capture", "replay", "replay"]
    assert model.counts == {"replay": 2, "capture": 1, "eager": 1}


def test_a_host_inputs_value_is_part_of_the_signature():
    # a replay never reads host inputs again (they shaped the launch at capture), so a new value
    # needs its own graph; a new shape too (device inputs, by shape only: the GPU test below)
    model = maxapi.ReplayedModel(StandIn(), capture_after=1)
    model.execute(host([1.0]), host(3, np.int64))
    model.execute(host([1.0]), host(4, np.int64))
    model.execute(host([1.0, 2.0]), host(3, np.int64))
    model.execute(host([1.0]), host(3, np.int64))
    assert [c for c in model.model.calls if c[0] == "capture"] == [("capture", 1), ("capture", 2), ("capture", 3)]
    assert len(model.graphs) == 3 and model.counts["replay"] == 4


def test_past_max_graphs_and_after_a_failed_capture_calls_stay_eager(caplog):
    model = maxapi.ReplayedModel(StandIn(), capture_after=1, max_graphs=1)
    model.execute(host([1.0]), host(1, np.int64))
    model.execute(host([1.0]), host(2, np.int64))
    assert model.counts == {"replay": 1, "capture": 1, "eager": 1}

    failing = maxapi.ReplayedModel(StandIn(fail_capture=True), name="sampler", capture_after=1)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert np.array_equal(failing.execute(host([1.0]), host(1, np.int64))[0].to_numpy(), [2.0])
    assert failing.counts == {"replay": 0, "capture": 0, "eager": 3} and len(failing.refused) == 1
    assert [r.getMessage() for r in caplog.records].count(
        "sampler: device graph capture failed (not capturable); this signature stays eager"
    ) == 1


def test_check_mode_compares_each_replay_with_an_eager_call_and_logs_the_first_mismatches(caplog, monkeypatch):
    monkeypatch.setattr(maxapi.ReplayedModel, "MISMATCHES_LOGGED", 1)
    for off, mismatches in [(0.0, 0), (0.5, 2)]:
        caplog.clear()
        model = maxapi.ReplayedModel(StandIn(off=off), name="sampler", capture_after=1, check=True)
        for _ in range(2):
            model.execute(host([1.0, 2.0]), host(3, np.int64))
        assert model.counts == {"replay": 2, "capture": 1, "eager": 0, "checked": 2, "mismatch": mismatches}
        assert [c for c, _ in model.model.calls] == ["capture", "replay", "execute", "replay", "execute"]
        logged = [r.getMessage() for r in caplog.records if "differs from an eager call" in r.getMessage()]
        if mismatches:  # the first only (MISMATCHES_LOGGED), naming the model, the outputs and both values
            assert len(logged) == 1 and logged[0].startswith("sampler: replay of graph 1")
            assert "outputs [0]" in logged[0] and "[[2.5, 3.5], [2.0, 3.0]]" in logged[0]
        else:
            assert logged == []


def test_captures_and_the_counts_are_logged(caplog, monkeypatch):
    # what a served run did (the server prints no counts otherwise): each capture with its shapes and
    # host values, and the counts every COUNTS_EVERY calls
    monkeypatch.setattr(maxapi.ReplayedModel, "COUNTS_EVERY", 3)
    model = maxapi.ReplayedModel(StandIn(), name="sampler", capture_after=2)
    with caplog.at_level(logging.INFO, logger="gptoss_max.maxapi"):
        for _ in range(7):
            model.execute(host([1.0, 2.0]), host(3, np.int64))
    logged = [r.getMessage() for r in caplog.records]
    assert [line.split("; host µs")[0] for line in logged] == [
        "sampler: captured graph 1 (input shapes [(2,), ()]; host values [[1.0, 2.0], 3])",
        "sampler: after 3 calls: {'replay': 2, 'capture': 1, 'eager': 1}, 0 signatures counted",
        "sampler: after 6 calls: {'replay': 5, 'capture': 1, 'eager': 1}, 0 signatures counted",
    ]
    # and the host time per call of each kind: both spent, each call counted once
    assert re.fullmatch(r".*; host µs per call \{'replay': [0-9.]+, 'eager': [0-9.]+\}", logged[2])
    assert model.host_s["replay"] > 0 and model.host_s["eager"] > 0


def test_one_off_signatures_are_not_counted_without_bound(monkeypatch):
    monkeypatch.setattr(maxapi.ReplayedModel, "SEEN_LIMIT", 3)
    model = maxapi.ReplayedModel(StandIn(), capture_after=2)
    for k in range(7):
        model.execute(host([1.0]), host(k, np.int64))
    assert len(model.seen) == 1 and model.counts == {"replay": 0, "capture": 0, "eager": 7}
    model.execute(host([1.0]), host(6, np.int64))  # the one still counted: captured on its 2nd call
    assert model.counts["capture"] == 1 and not model.seen


def test_inputs_a_replay_could_not_refresh_keep_the_call_eager():
    model = maxapi.ReplayedModel(StandIn(), capture_after=1)
    model.execute(host(np.zeros(maxapi.ReplayedModel.HOST_KEY_ELEMENTS + 1)), host(1, np.int64))
    model.execute(host([1.0]), "not a buffer")
    assert model.counts == {"replay": 0, "capture": 0, "eager": 2} and not model.graphs


def test_replay_overlap_graphs_wraps_the_pipelines_per_step_graphs_once():
    # the touchpoints: MAX 26.7's overlap pipeline keeps its sampler and the scatter's graph here
    import inspect

    from max.pipelines.lib.pipeline_variants import overlap_text_generation as otg
    from max.pipelines.sampling import sampling_logits_processor as slp

    source = inspect.getsource(otg.OverlapTextGenerationPipeline)
    assert "sampler=self._sampler_without_bitmask" in source and "sampler=self._sampler_with_bitmask" in source
    assert "self.tensor_bitmask = self._pinned_bitmask.to(self.device)" in inspect.getsource(slp.FusedSamplingProcessor)
    assert "self._realize_future_token_processor.realize_future_tokens(" in source
    assert "self._graph.execute(*tree.leaves(my_inputs))" in inspect.getsource(otg.RealizeFutureTokenProcessor)
    assert "sampler(*graph_inputs)" in inspect.getsource(slp._sample_logits)

    class Realize:
        _graph = StandIn()

    class Pipeline:
        _sampler_without_bitmask = StandIn()
        _sampler_with_bitmask = None  # structured output off
        _realize_future_token_processor = Realize()

    from gptoss_max.settings import REPLAYABLE_GRAPHS

    pipeline = Pipeline()
    wrapped = maxapi.replay_overlap_graphs(pipeline, REPLAYABLE_GRAPHS)
    assert [w.name for w in wrapped] == ["sampler", "realize_future_token"]
    with_bitmask = Pipeline()
    with_bitmask._sampler_with_bitmask = StandIn()
    with_bitmask._sampler_without_bitmask = StandIn()
    with_bitmask._realize_future_token_processor = Realize()
    names = [w.name for w in maxapi.replay_overlap_graphs(with_bitmask)]  # by default the samplers only
    assert names == ["sampler", "sampler_bitmask"]
    assert isinstance(with_bitmask._realize_future_token_processor._graph, StandIn)
    assert (
        pipeline._sampler_without_bitmask is wrapped[0]
        and pipeline._realize_future_token_processor._graph is wrapped[1]
    )
    assert maxapi.replay_overlap_graphs(pipeline, REPLAYABLE_GRAPHS) == []  # already wrapped
    assert maxapi.replay_overlap_graphs(object()) == []  # not the overlap pipeline
    some = Pipeline()
    some._sampler_with_bitmask = StandIn()
    some._realize_future_token_processor = Realize()
    assert [w.name for w in maxapi.replay_overlap_graphs(some, ["sampler_bitmask"])] == ["sampler_bitmask"]
    assert isinstance(some._sampler_without_bitmask, StandIn)
    assert isinstance(some._realize_future_token_processor._graph, StandIn)


def test_the_scatter_replays_only_on_tokens_a_replayed_sampler_wrote():
    # replayed on an eager sampler's tokens the scatter crashed the server's worker (H200); both
    # replayed, or the scatter eager, passed: the scatter is held eager unless an input lives where
    # a replayed sampler's captured outputs do (a view of one counts: same memory)
    from gptoss_max.settings import REPLAYABLE_GRAPHS

    class Realize:
        def __init__(self):
            self._graph = StandIn()

    class Pipeline:
        def __init__(self):
            self._sampler_without_bitmask = StandIn()
            self._realize_future_token_processor = Realize()

    pipeline = Pipeline()
    sampler, scatter = maxapi.replay_overlap_graphs(pipeline, REPLAYABLE_GRAPHS, capture_after=1)
    k = host(3, np.int64)
    for _ in range(3):  # an eager sampler's tokens: fresh memory each step
        scatter.execute(host([1.0, 2.0]), k)
    assert scatter.counts == {"replay": 0, "capture": 0, "eager": 3, "held": 3} and not scatter.graphs
    (tokens,) = sampler.execute(host([5.0, 6.0]), k)  # captured and replayed: its own output buffer
    assert sampler.counts["replay"] == 1 and tokens._data_ptr() in sampler.output_ptrs
    for _ in range(2):
        (out,) = scatter.execute(tokens.view(tokens.dtype, [2]), k)
    assert np.array_equal(out.to_numpy(), [7.0, 8.0])
    assert scatter.counts == {"replay": 2, "capture": 1, "eager": 3, "held": 3}
    scatter.execute(host([1.0, 2.0]), k)  # the sampler eager again (a new signature): held, not replayed
    assert scatter.counts["held"] == 4 and scatter.counts["replay"] == 2
    only = Pipeline()  # the scatter alone: no replayed sampler, so it never replays
    (alone,) = maxapi.replay_overlap_graphs(only, ["realize_future_token"], capture_after=1)
    alone.execute(tokens, k)
    assert alone.counts["held"] == 1 and not alone.graphs


def test_replay_in_mode_maps_the_flags_modes(monkeypatch):
    class Pipeline:
        def __init__(self):
            self._sampler_without_bitmask = StandIn()

    monkeypatch.delenv("GPTOSS_MAX_REPLAY_GRAPHS", raising=False)
    assert maxapi.replay_in_mode(Pipeline(), "off") == []
    (on,) = maxapi.replay_in_mode(Pipeline(), "on")
    (checked,) = maxapi.replay_in_mode(Pipeline(), "check")
    assert on.name == checked.name == "sampler" and checked.check and not on.check
    with pytest.raises(ValueError, match="replay mode 'yes'; choose from off, on, check"):
        maxapi.replay_in_mode(Pipeline(), "yes")


def test_the_graphs_to_replay_are_a_setting(monkeypatch):
    from gptoss_max import settings

    monkeypatch.delenv("GPTOSS_MAX_REPLAY_GRAPHS", raising=False)
    assert settings.replay_graphs() == ("sampler", "sampler_bitmask")  # the scatter is opt-in
    monkeypatch.setenv("GPTOSS_MAX_REPLAY_GRAPHS", "all")
    assert settings.replay_graphs() == ("sampler", "sampler_bitmask", "realize_future_token")
    monkeypatch.setenv("GPTOSS_MAX_REPLAY_GRAPHS", "sampler, realize_future_token")
    assert settings.replay_graphs() == ("sampler", "realize_future_token")
    assert "GPTOSS_MAX_REPLAY_GRAPHS=sampler, realize_future_token" in settings.run_setting_env()
    monkeypatch.setenv("GPTOSS_MAX_REPLAY_GRAPHS", "sampler,scatter")
    with pytest.raises(ValueError, match=r"names \['scatter'\]; choose from sampler, sampler_bitmask"):
        settings.replay_graphs()


def test_engine_options_need_graph_capture_for_it():
    from gptoss_max.engine import EngineOptions, pipeline_args

    with pytest.raises(ValueError, match="replay_small_graphs needs graph_capture"):
        pipeline_args(EngineOptions(model="synthetic:tiny", device="cpu", replay_small_graphs="on"))


def _gather_scale(kind: str):
    """out = x[idx] * scale, all on the device: a gather, like the future-token scatter. (A host
    input moved to the device inside a graph cannot be captured: MAX's capture fails with
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED on the H200, and the call stays eager.)"""
    from max.dtype import DType
    from max.graph import TensorType, ops

    def forward(x, idx, scale):
        return ops.gather(x, idx, axis=0) * scale

    return load_op_graph(
        kind,
        "replayed_gather",
        forward,
        lambda dev: [
            TensorType(DType.float32, ["N"], dev),
            TensorType(DType.int64, ["B"], dev),
            TensorType(DType.float32, [1], dev),
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", op_devices())
def test_replayed_results_equal_eager_ones_call_after_call(kind):
    from max.driver import Buffer

    device, raw = _gather_scale(kind)
    model = maxapi.ReplayedModel(raw, name="gather", capture_after=2, check=kind == "gpu")
    rng = np.random.default_rng(0)
    pending = []
    for step in range(8):
        x = rng.standard_normal(64).astype(np.float32)
        idx = rng.integers(0, 64, size=3 if step < 6 else 5)
        scale = np.array([2.0 if step % 3 else 0.5], np.float32)
        (out,) = model.execute(*(Buffer.from_numpy(a).to(device) for a in (x, idx, scale)))
        pending.append((out.to_numpy().copy(), x[idx] * scale))  # read before the next call overwrites it
    for got, want in pending:
        np.testing.assert_array_equal(got, want)
    if kind == "cpu":  # host inputs are keyed by value, and MAX captures on GPUs only
        same = [Buffer.from_numpy(a) for a in (np.ones(4, np.float32), np.arange(2), np.array([x[0]]))]
        for _ in range(3):  # the 2nd call tries to capture, is refused, and the 3rd does not try again
            np.testing.assert_array_equal(model.execute(*same)[0].to_numpy(), [x[0], x[0]])
        assert model.counts == {"replay": 0, "capture": 0, "eager": 11} and len(model.refused) == 1
    else:  # length 3: eager once, then captured and replayed 5 times; length 5: eager, then replayed
        assert model.counts == {"replay": 6, "capture": 2, "eager": 2, "checked": 6, "mismatch": 0}


def test_serve_wraps_the_workers_pipeline_when_asked_and_needs_graph_capture_for_it(tmp_path, monkeypatch):
    import argparse

    from gptoss_max.cli import build_parser
    from gptoss_max.server.cli import pipeline_args
    from gptoss_max.server.kv_probe import ProbedFactory

    class Realize:
        _graph = StandIn()

    class Pipeline:
        kv_manager = None  # no KV probe thread
        _sampler_without_bitmask = StandIn()
        _realize_future_token_processor = Realize()

    plain = ProbedFactory(Pipeline, tmp_path / "kv.json")()
    assert isinstance(plain._sampler_without_bitmask, StandIn)
    wrapped = ProbedFactory(Pipeline, tmp_path / "kv.json", replay_small_graphs="on")()
    assert isinstance(wrapped._sampler_without_bitmask, maxapi.ReplayedModel)
    assert isinstance(wrapped._realize_future_token_processor._graph, StandIn)  # the scatter: opt-in
    monkeypatch.setenv("GPTOSS_MAX_REPLAY_GRAPHS", "all")
    every = ProbedFactory(Pipeline, tmp_path / "kv.json", replay_small_graphs="on")()
    assert isinstance(every._realize_future_token_processor._graph, maxapi.ReplayedModel)
    monkeypatch.delenv("GPTOSS_MAX_REPLAY_GRAPHS")

    checked = ProbedFactory(Pipeline, tmp_path / "kv.json", replay_small_graphs="check")()
    assert checked._sampler_without_bitmask.check and not wrapped._sampler_without_bitmask.check

    serve = ["serve", "--model", "synthetic:tiny", "--graph-capture", "off"]  # off on any machine
    args = build_parser().parse_args([*serve, "--replay-small-graphs"])
    assert args.replay_small_graphs == "on" and isinstance(args, argparse.Namespace)
    assert build_parser().parse_args(serve).replay_small_graphs == "off"
    assert build_parser().parse_args([*serve, "--replay-small-graphs", "check"]).replay_small_graphs == "check"
    with pytest.raises(ValueError, match="replay_small_graphs needs graph_capture"):
        pipeline_args(args)
