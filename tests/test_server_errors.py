"""Errors in OpenAI's shape, and the small routes: bad input never yields a 500."""

import contextlib

import httpx
import openai
import pytest
from openai import OpenAI

from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from server_fixtures import FINAL, WEATHER_TOOL, serving

DROP = object()


@pytest.fixture
def server(tmp_path):
    with contextlib.ExitStack() as stack:

        def start(**engine_kw):
            engine = ScriptedEngine([FINAL], **engine_kw)
            app = build_app(
                engine, tmp_path / "r.sqlite3", enable_bench=engine_kw.pop("bench", False)
            )
            base = stack.enter_context(serving(app))
            return engine, base, OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

        yield start


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    engine = ScriptedEngine([FINAL])
    app = build_app(engine, tmp_path_factory.mktemp("store") / "r.sqlite3")
    with serving(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        yield engine, http


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def post(base, body, path="/v1/responses", **kw):
    return httpx.post(f"{base}{path}", timeout=10, **({"json": body} if body is not None else kw))


def test_malformed_json_and_non_objects(server):
    _, base, _ = server()
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = post(base, None, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "hi", "model": DROP}, "model", "missing_required_parameter"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "invalid_value"),
        ({"input": "hi", "stream": "yes"}, "stream", "invalid_value"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty", "unsupported_parameter"),
        (
            {"input": "hi", "reasoning": {"effort": "low", "x": 1}},
            "reasoning.x",
            "unsupported_parameter",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0]", "unsupported_type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
            "unsupported_parameter",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
        (
            {"input": "hi", "tools": [{**WEATHER_TOOL, "parameters": {"type": "string"}}]},
            "tools[0].parameters",
            "invalid_function_parameters",
        ),
        (
            {"input": "hi", "tools": [{**WEATHER_TOOL, "parameters": {"required": 3}}]},
            "tools[0].parameters",
            "invalid_schema",
        ),
        ({"input": "hi", "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].name", None),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", None),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", None),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format", None),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id",
            None,
        ),
        ({"input": "hi", "model": "gpt-5"}, "model", "model_not_found"),
        # OpenAI's metadata limits: 16 pairs, keys of up to 64 characters, values of up to 512
        ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65, "invalid_value"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k", "invalid_value"),
        ({"input": "hi", "background": 0}, "background", "invalid_value"),  # pydantic's Literal[False] took 0
    ],
)
def test_bad_requests_name_the_field(shared, body, param, code):
    engine, http = shared
    body = {k: v for k, v in {"model": engine.model_name, **body}.items() if v is not DROP}
    before = len(engine.prompts)
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    assert len(engine.prompts) == before, "nothing reached the engine"


def _post_raw(http, path, raw):
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def test_unpaired_surrogates_are_400_not_500(shared):
    # JSON can escape half of a UTF-16 pair (\ud800); no UTF-8 text holds one, and Harmony's
    # renderer failed on it with a 500 (found by hand against the tiny model's server)
    engine, http = shared
    model = engine.model_name
    before = len(engine.prompts)
    text_part = '[{"role": "user", "content": [{"type": "input_text", "text": "x\\udc00"}]}]'
    cases = [
        ('"input": "a\\ud800b"', "input"),
        (f'"input": {text_part}', "input[0].content[0].text"),
        ('"input": "hi", "metadata": {"k\\ud83d": "v"}', "metadata.k\\ud83d"),
        ('"input": "hi", "instructions": "\\ud83d"', "instructions"),
    ]
    for fields, param in cases:
        r = _post_raw(http, "/v1/responses", f'{{"model": "{model}", {fields}}}')
        assert r.status_code == 400, (fields, r.text)
        err = error_of(r)
        assert err["param"] == param and err["code"] == "invalid_value", err
    chat = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\udfff"}}]}}'
    r = _post_raw(http, "/v1/chat/completions", chat)
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].content"
    assert len(engine.prompts) == before, "nothing reached the engine"
    # a whole pair (an emoji, escaped) is text
    r = _post_raw(http, "/v1/responses", f'{{"model": "{model}", "input": "\\ud83d\\ude00"}}')
    assert r.status_code == 200, r.text


def test_unknown_paths_and_methods_are_openai_shaped(shared):
    _, http = shared
    r = http.get("/v1/nope")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    assert "/v1/nope" in error_of(r)["message"]
    r = http.put("/v1/responses")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_prompt_too_long(server):
    engine, _, client = server(max_context=64)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=engine.model_name, input="hello " * 100)
    assert err.value.body["code"] == "context_length_exceeded"


def test_unknown_ids_are_404(server):
    engine, base, client = server()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    assert httpx.delete(f"{base}/v1/responses/resp_nope").status_code == 404
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(
            model=engine.model_name, input="x", previous_response_id="resp_nope"
        )
    assert err.value.body["param"] == "previous_response_id"


def test_full_queue_is_429_and_streams_too(server):
    engine, base, client = server(capacity=0)
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model=engine.model_name, input="x")
    r = post(base, {"model": engine.model_name, "input": "x", "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert error_of(r)["type"] == "rate_limit_error"


def test_fuzzed_bodies_never_500(shared):
    engine, http = shared
    odd = [
        None,
        1,
        "x",
        [],
        {},
        {"a": None},
        [{"type": 1}],
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"type": "reasoning", "content": "x"}],
        10**30,
    ]
    for field in ("input", "tools", "tool_choice", "text", "reasoning", "metadata", "instructions"):
        for value in odd:
            r = http.post(
                "/v1/responses", json={"model": engine.model_name, "input": "hi", field: value}
            )
            assert r.status_code < 500, (field, value, r.text)
    r = http.post("/v1/responses", content=b'{"model": "m", "input": 1e999}')
    assert r.status_code == 400
    for depth in (900, 100_000):  # deeper than Python's recursion limit, and not
        nested = b'{"model": "m", "input": "hi", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        r = http.post("/v1/responses", content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.text)
    assert http.get("/health").status_code == 200


def test_one_model_retrieved_by_its_id_slash_and_all(server):
    engine, base, client = server(model_name="openai/gpt-oss-20b")
    got = client.models.retrieve("openai/gpt-oss-20b")
    assert got.id == "openai/gpt-oss-20b" and got.object == "model" and got.owned_by == "gptoss-max"
    assert got.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["param"] == "model" and err.value.body["code"] == "not_found"


def test_health_models_metrics_and_bench_switch(server):
    engine, base, client = server()
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list()] == [engine.model_name]
    client.responses.create(model=engine.model_name, input="hi")
    metrics = httpx.get(f"{base}/metrics").text
    assert 'gptoss_requests_total{endpoint="responses",status="completed"}' in metrics
    assert httpx.get(f"{base}/bench").status_code == 404


def test_bench_probe(tmp_path):
    engine = ScriptedEngine(["<|channel|>final<|message|>" + " x" * 100], chunk_size=4)
    with serving(build_app(engine, tmp_path / "r.sqlite3", enable_bench=True)) as base:
        r = httpx.get(f"{base}/bench", params={"n": 3, "max_new_tokens": 16}, timeout=10)
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["n"] == 3 and report["output_tokens"] == 48 and report["tok_per_s"] > 0
        assert all(p.ignore_eos and p.temperature == 1.0 for p in engine.params)
        assert httpx.get(f"{base}/bench", params={"n": 0}).status_code == 400
        greedy = httpx.get(f"{base}/bench", params={"n": 1, "max_new_tokens": 4, "temperature": 0}, timeout=10)
        assert greedy.status_code == 200 and greedy.json()["temperature"] == 0 and engine.params[-1].temperature == 0
        hot = httpx.get(f"{base}/bench", params={"temperature": 2.5})
        assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"


def test_api_key(server, monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_API_KEY", "sekrit")
    engine, base, _ = server()
    assert post(base, {"model": engine.model_name, "input": "x"}).status_code == 401
    ok = OpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0)
    assert ok.responses.create(model=engine.model_name, input="x").status == "completed"
    assert httpx.get(f"{base}/health").status_code == 200
