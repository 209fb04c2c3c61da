"""Hypothesis-generated token sequences through the Harmony stream parser, alone and through the server.

Any sequence (Harmony's special tokens, header words, any id of the vocabulary) must parse
without an exception into well-formed events; a well-formed Harmony output must parse back
into exactly the messages it was made of; and through the server (a scripted engine playing
the sequence) every request ends properly: HTTP 200 with a completed, incomplete or failed
response, a stream with its terminal event, never a 5xx.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_max.harmony.parse import HarmonyStream, ItemDone, ItemStarted, TextDelta
from gptoss_max.harmony.render import CALL, CHANNEL, CONSTRAIN, END, END_OF_TEXT, MESSAGE, RETURN, START, encode_harmony
from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from reporting import report
from server_fixtures import serving

VOCAB = 201_088  # o200k_harmony, special tokens included
SPECIALS = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, END_OF_TEXT]
WORDS = sorted({t for w in ("assistant", "analysis", "final", "commentary", " to=functions.get_weather",
                            " json", "user", "Hello", " world", '{"a": 1}', " <", "|>", "functions", "é", "😊")
                for t in encode_harmony(w)})  # fmt: skip
token = st.one_of(st.sampled_from(SPECIALS), st.sampled_from(WORDS), st.integers(0, VOCAB - 1))
tokens = st.lists(token, max_size=120)
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
COUNTS: dict[str, int] = {}


def check_events(events: list) -> list[tuple]:
    """Events are ItemStarted, TextDelta..., ItemDone in turn, the deltas adding up to the text."""
    items, open_, deltas = [], None, []
    for ev in events:
        if isinstance(ev, ItemStarted):
            assert open_ is None, "an item starts inside another"
            open_, deltas = ev, []
        elif isinstance(ev, TextDelta):
            assert open_ is not None, "text outside an item"
            assert isinstance(ev.text, str)
            deltas.append(ev.text)
        else:
            assert isinstance(ev, ItemDone) and open_ is not None, "an item ends that never started"
            assert "".join(deltas) == ev.text
            items.append((open_.kind, open_.name, open_.phase, ev.text, ev.complete))
            open_ = None
    assert open_ is None, "finish() closes what is open"
    return items


def parse(ids: list[int], truncated: bool) -> tuple[list[tuple], HarmonyStream]:
    stream = HarmonyStream()
    events = []
    for t in ids:
        out = stream.feed(t)
        if stream.error:
            assert stream.feed(t) == [], "nothing after an error"
        events += out
    events += stream.finish(truncated=truncated)
    assert stream.finish(truncated=truncated) == [], "finish is once"
    return check_events(events), stream


def test_found_by_fuzzing():
    """Deltas did not add up to the final text: a lone UTF-8 lead byte held back to the end (its
    replacement character came only in the final text), and a message without a header."""
    assert parse([MESSAGE, 126], truncated=False)[0] == [("message", None, "final_answer", "\ufffd", True)]
    assert parse([START, END], truncated=False)[0] == [("message", None, "final_answer", "<|start|>", True)]


@settings(FUZZ, max_examples=1500)
@given(ids=tokens, truncated=st.booleans())
def test_any_token_sequence_parses_into_well_formed_events(ids, truncated):
    items, stream = parse(ids, truncated)
    assert stream.finished
    assert stream.reasoning_tokens <= len(ids)
    COUNTS["parser"] = COUNTS.get("parser", 0) + 1


text = st.text(st.characters(blacklist_characters="<|", blacklist_categories=("Cs",)), min_size=1, max_size=30)
name = st.from_regex(r"[a-z][a-z_]{0,9}", fullmatch=True)
message = st.one_of(
    st.tuples(st.just("reasoning"), st.none(), text),
    st.tuples(st.just("commentary"), st.none(), text),
    st.tuples(st.just("call"), name, text),
)


@settings(FUZZ, max_examples=500)
@given(body=st.lists(message, max_size=4), last=st.one_of(st.tuples(st.just("final"), st.none(), text),
                                                         st.tuples(st.just("call"), name, text)))  # fmt: skip
def test_well_formed_output_parses_back_exactly(body, last):
    parts = []
    for i, (kind, fn, content) in enumerate([*body, last]):
        head = "" if i == 0 else "<|start|>assistant"
        end = "<|end|>" if i < len(body) else ("<|return|>" if kind == "final" else "<|call|>")
        if kind == "call" and i < len(body):
            end = "<|call|><|start|>functions.x to=assistant<|channel|>commentary<|message|>{}<|end|>"
        channel = {"reasoning": "analysis", "commentary": "commentary", "final": "final"}.get(kind, "commentary")
        to = f" to=functions.{fn} <|constrain|>json" if kind == "call" else ""
        parts.append(f"{head}<|channel|>{channel}{to}<|message|>{content}{end}")
    items, stream = parse(encode_harmony("".join(parts)), truncated=False)
    assert stream.error is None
    expected = [({"reasoning": "reasoning", "call": "function_call"}.get(k, "message"), fn,
                 {"commentary": "commentary", "final": "final_answer"}.get(k), content, True)
                for k, fn, content in [*body, last]]  # fmt: skip
    assert items == expected
    COUNTS["round trip"] = COUNTS.get("round trip", 0) + 1


SCRIPT: list[list[int]] = [[]]
ENGINE = ScriptedEngine(lambda prompt: SCRIPT[0], chunk_size=3)


@pytest.fixture(scope="module")
def http():
    with serving(build_app(ENGINE, ":memory:")) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield client


@settings(FUZZ, max_examples=100)
@given(ids=tokens)
def test_any_token_sequence_through_the_server(http, ids):
    SCRIPT[0] = ids
    expected, stream = parse(ids[: next((i + 1 for i, t in enumerate(ids) if t in (RETURN, CALL, END_OF_TEXT)),
                                       len(ids))], truncated=False)  # fmt: skip
    body = {"model": ENGINE.model_name, "input": "fuzz", "max_output_tokens": 200}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["status"] in ("completed", "incomplete", "failed")
    assert (resp["status"] == "failed") == (stream.error is not None)
    assert len(resp["output"]) == len(expected)
    assert http.get(f"/v1/responses/{resp['id']}").json()["status"] == resp["status"]
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    chat = {"model": ENGINE.model_name, "messages": [{"role": "user", "content": "fuzz"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as s:
        assert s.status_code == 200
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    COUNTS["server"] = COUNTS.get("server", 0) + 1


def test_report_counts(http):
    assert http.get("/health").json()["status"] == "ok"
    assert COUNTS.get("server", 0) > 0
    report("fuzz", "hypothesis token sequences: " + ", ".join(f"{k} {v}" for k, v in COUNTS.items()))
