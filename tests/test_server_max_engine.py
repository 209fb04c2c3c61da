"""MaxEngine over a stand-in for MAX's TokenGeneratorPipeline (MAX's real types, no model)."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from max.pipelines.context import GenerationStatus, InputError, PromptTooLongError
from max.serve.pipelines.llm import TokenGeneratorOutput
from max.serve.worker_interface import RequestQueueFull
from openai import OpenAI

from gptoss_max.harmony.render import encode_harmony
from gptoss_max.server.app import build_app, mount
from gptoss_max.server.engine import GenParams, PromptTooLong, QueueFull, Rejected
from gptoss_max.server.max_engine import MaxEngine
from gptoss_max.server.state import ServerState
from gptoss_max.server.store import SQLiteStore
from server_fixtures import FINAL, serving


class FakePipeline:
    """Streams `script` in chunks of 3 ids, as TokenGeneratorOutputs."""

    def __init__(self, script, error=None, stream_error=None):
        self.script, self.error, self.stream_error = script, error, stream_error
        self.requests, self.cancelled, self.closed = [], [], 0
        self.model_worker = SimpleNamespace(cancel=self.cancelled.append)

    async def next_token_chunk(self, request, *, parse_reasoning=True):
        assert parse_reasoning is False
        if self.error:
            raise self.error
        self.requests.append(request)
        return self._outputs(request)

    async def _outputs(self, request):
        ids = self.script[: request.sampling_params.max_new_tokens]
        if self.stream_error:  # how the worker's refusal arrives (zmq_interface raises it)
            raise self.stream_error
        try:
            for i in range(0, len(ids), 3):
                last = i + 3 >= len(ids)
                status = GenerationStatus.END_OF_SEQUENCE if last else GenerationStatus.ACTIVE
                yield TokenGeneratorOutput(
                    status=status,
                    token_ids=ids[i : i + 3],
                    cached_token_count=5 if i == 0 else None,
                )
                await asyncio.sleep(0)
        finally:
            self.closed += 1


def engine_for(pipeline, max_context=4096):
    app = SimpleNamespace(state=SimpleNamespace(pipeline=pipeline))
    return MaxEngine(app, "gpt-oss-max", max_context)


async def collect(engine, params, stop_after=None):
    out, it = [], engine.generate([1, 2, 3], params)
    async for chunk in it:
        out.append(chunk)
        if stop_after and len(out) == stop_after:
            await it.aclose()
            break
    return out


def test_streams_token_ids_with_the_request_it_built():
    pipe = FakePipeline(list(range(10)))
    chunks = asyncio.run(collect(engine_for(pipe), GenParams(max_new_tokens=8, temperature=0.3)))
    assert [list(c) for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert chunks[0].cached_tokens == 5
    [req] = pipe.requests
    assert req.prompt == [1, 2, 3] and req.model_name == "gpt-oss-max"
    sp = req.sampling_params
    assert sp.max_new_tokens == 8 and sp.temperature == 0.3
    assert sp.stop_token_ids == [200002, 200012, 199999] and not sp.ignore_eos
    assert pipe.cancelled == [] and pipe.closed == 1


def test_leaving_early_cancels_in_the_worker():
    pipe = FakePipeline(list(range(30)))
    asyncio.run(collect(engine_for(pipe), GenParams(max_new_tokens=30), stop_after=2))
    assert pipe.cancelled == [pipe.requests[0].request_id] and pipe.closed == 1


@pytest.mark.parametrize(
    ("error", "expected"),
    [(RequestQueueFull("full"), QueueFull), (PromptTooLongError(9000, 4096), PromptTooLong)],
)
def test_admission_errors_map_to_engine_errors(error, expected):
    with pytest.raises(expected):
        asyncio.run(collect(engine_for(FakePipeline([], error=error)), GenParams(8)))


def test_a_grammar_goes_as_a_response_format_enforced_from_the_first_token():
    pipe = FakePipeline([1, 2])
    asyncio.run(collect(engine_for(pipe), GenParams(8, grammar='{"type":"structural_tag"}')))
    asyncio.run(collect(engine_for(pipe), GenParams(8)))
    constrained, plain = pipe.requests
    fmt = constrained.response_format
    assert (fmt.type, fmt.grammar, fmt.grammar_enforced) == ("grammar", '{"type":"structural_tag"}', True)
    assert plain.response_format is None


def test_the_workers_refusal_of_a_grammar_is_a_400(tmp_path):
    refusal = InputError("Grammar provided in request cannot be compiled. From xgrammar: bad")
    with pytest.raises(Rejected, match="cannot be compiled"):
        asyncio.run(collect(engine_for(FakePipeline([1], stream_error=refusal)), GenParams(8)))
    engine = engine_for(FakePipeline([1], stream_error=refusal))
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        r = httpx.post(f"{base}/v1/responses", json={"model": "gpt-oss-max", "input": "x", "stream": True})
    assert r.status_code == 400 and "cannot be compiled" in r.json()["error"]["message"]


def test_server_over_max_engine(tmp_path):
    pipe = FakePipeline(encode_harmony(FINAL))
    engine = engine_for(pipe)
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        resp = client.responses.create(model="gpt-oss-max", input="Hi")
    assert resp.output_text == "Hello there!"
    assert resp.usage.input_tokens_details.cached_tokens == 5
    assert pipe.cancelled == []


def test_mount_replaces_max_routes_at_our_paths(tmp_path):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def max_chat():
        return {"from": "max"}

    @app.post("/v1/completions")
    async def max_completions():
        return {"from": "max"}

    engine = engine_for(FakePipeline(encode_harmony(FINAL)))
    mount(app, ServerState(engine, SQLiteStore(tmp_path / "r.sqlite3")))
    with serving(app) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="gpt-oss-max", messages=[{"role": "user", "content": "Hi"}]
        )
        assert chat.choices[0].message.content == "Hello there!"
        assert httpx.post(f"{base}/v1/completions", json={}).json() == {"from": "max"}
        assert client.responses.create(model="gpt-oss-max", input="Hi").status == "completed"


def test_api_key_guards_max_routes_too(tmp_path, monkeypatch):
    app = FastAPI()

    @app.post("/v1/completions")
    async def max_completions():
        return {"from": "max"}

    @app.get("/health")
    async def health():
        return {"ok": True}

    engine = engine_for(FakePipeline(encode_harmony(FINAL)))
    mount(app, ServerState(engine, SQLiteStore(tmp_path / "r.sqlite3")))
    monkeypatch.setenv("GPTOSS_MAX_API_KEY", "sekrit")
    with serving(app) as base:
        denied = httpx.post(f"{base}/v1/completions", json={})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        allowed = httpx.post(f"{base}/v1/completions", json={}, headers={"authorization": "Bearer sekrit"})
        assert allowed.json() == {"from": "max"}
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.post(f"{base}/v1/responses", json={"model": "gpt-oss-max", "input": "x"}).status_code == 401


def test_serving_config_turns_grammar_masking_on_even_on_cpu(tmp_path):
    """Without it MAX's worker silently ignores grammars; MAX refuses it on CPU at validation only."""
    import argparse

    from max.pipelines.lib import PipelineConfig

    from gptoss_max.cli import make_tiny
    from gptoss_max.server.cli import pipeline_args, with_constrained_decoding

    make_tiny(tmp_path / "tiny", "mxfp4", seed=0)
    args = argparse.Namespace(model=str(tmp_path / "tiny"), devices="cpu", max_length=512, max_batch_size=1,
                              served_model_name=None)  # fmt: skip
    config = PipelineConfig.from_args(pipeline_args(args))
    assert not config.needs_bitmask_constraints
    config = with_constrained_decoding(config)
    assert config.sampling.enable_structured_output and config.needs_bitmask_constraints
