"""The turn grammar masking scripted logits (random, or biased against it), in process.

Logits are noise, so whatever parses and validates does so because of the mask. Parsing
goes through the server's own HarmonyStream, as the generated ids would.
"""

import json

import numpy as np
import pytest

from gptoss_max.harmony.grammar import FIRST_SPECIAL, VOCAB_SIZE, turn_grammar
from gptoss_max.harmony.parse import ItemDone, ItemStarted, parse_completion
from gptoss_max.harmony.render import CALL, END, RETURN, FunctionTool, ResponseFormat, TurnSpec, encode_harmony
from grammar_engine import STOPS, Masked, random_logits, sample, vocab
from structured_cases import SCHEMAS, TOOL_SCHEMAS, TOOLS, valid

REASONING = 16
FUNCS = tuple(FunctionTool(t["name"], t["description"], t["parameters"], True) for t in TOOLS)


def grammar(spec: TurnSpec, reasoning: int | None = REASONING) -> str:
    tag = turn_grammar(spec, reasoning)
    assert tag is not None
    return json.dumps(tag)


def items(ids: list[int], truncated: bool = False) -> list[tuple[str, str | None, str]]:
    """(kind, function name, text) per output item; all complete unless `truncated` (the last)."""
    out, start = [], None
    for event in parse_completion(ids, truncated):
        if isinstance(event, ItemStarted):
            start = event
        elif isinstance(event, ItemDone):
            assert start is not None and (event.complete or truncated)
            out.append((start.kind, start.name, event.text))
    return out


def biased(seed: int, toward: list[int], by: float):
    logits = random_logits(seed)

    def f(ids):
        out = logits(ids)
        out[toward] += by
        return out

    return f


@pytest.mark.parametrize("seed, name", list(enumerate(SCHEMAS)))
def test_json_schema_answers_validate(seed, name):
    spec = TurnSpec(response_format=ResponseFormat("json_schema", name, SCHEMAS[name], strict=True))
    ids = sample(grammar(spec), random_logits(seed), 600)
    assert ids[-1] in STOPS, "the answer ended within its budget"
    *before, (kind, _, text) = items(ids)
    assert [k for k, _, _ in before] in ([], ["reasoning"]) and kind == "message"
    valid(text, SCHEMAS[name])


def test_reasoning_is_capped_and_ends_with_end():
    spec = TurnSpec(response_format=ResponseFormat("json_schema", "e", SCHEMAS["enum"], strict=True))
    run = Masked(grammar(spec, reasoning=5), random_logits(1))
    for token in encode_harmony("<|channel|>analysis<|message|>"):
        assert run.allowed()[token]
        run.matcher.accept_token(token)
    for _ in range(5):
        run.step()
    allowed = np.flatnonzero(run.allowed())
    assert allowed.tolist() == [END], "after 5 reasoning tokens only <|end|> is left"


def test_specials_are_refused_inside_bodies_even_when_the_logits_want_them():
    specials = list(range(FIRST_SPECIAL, VOCAB_SIZE))
    spec = TurnSpec(response_format=ResponseFormat("json_schema", "m", SCHEMAS["mixed"], strict=True))
    for seed in range(3):
        ids = sample(grammar(spec, reasoning=None), biased(seed, specials, 50.0), 600)
        *_, (kind, _, text) = items(ids)
        assert kind == "message"
        valid(text, SCHEMAS["mixed"])


def test_json_object_and_non_strict_arguments_are_objects():
    """Open objects have no bound under noise: the logits lean toward `"` and `}` (still noise)."""
    closing = [t for t, b in enumerate(vocab()[:FIRST_SPECIAL]) if b'"' in b or b"}" in b]
    spec = TurnSpec(response_format=ResponseFormat("json_object"))
    for seed in range(3):
        *_, (kind, _, text) = items(sample(grammar(spec), biased(seed, closing, 4.0), 800))
        assert kind == "message" and isinstance(json.loads(text), dict)
    loose = FunctionTool("search", "Search", {"type": "object", "properties": {"q": {"type": "string"}}})
    spec = TurnSpec(tools=(loose,), tool_choice="search")
    for seed in range(3):
        *_, (kind, name, text) = items(sample(grammar(spec), biased(seed, closing, 4.0), 800))
        assert (kind, name) == ("function_call", "search") and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_forced_calls_name_a_right_function_with_valid_arguments(choice):
    spec = TurnSpec(tools=FUNCS, tool_choice=choice)
    for seed in range(4):
        ids = sample(grammar(spec), random_logits(seed), 600)
        *before, (kind, name, text) = items(ids)
        assert set(k for k, _, _ in before) <= {"reasoning", "message"} and kind == "function_call"
        assert name == choice or (choice == "required" and name in TOOL_SCHEMAS)
        valid(text, TOOL_SCHEMAS[name])


def test_auto_with_tools_keeps_harmony_framing_and_valid_arguments():
    """A plain final answer may run to the budget (noise seldom stops); calls always close."""
    spec = TurnSpec(tools=FUNCS, tool_choice="auto")
    lasts = set()
    for seed in range(30):
        ids = sample(grammar(spec), random_logits(seed), 200)
        *before, (kind, name, text) = items(ids, truncated=ids[-1] not in STOPS)
        assert {k for k, _, _ in before} <= {"reasoning", "message"}
        lasts.add(kind)
        if kind == "function_call":
            assert ids[-1] in STOPS
            valid(text, TOOL_SCHEMAS[name])
    assert lasts == {"message", "function_call"}


def test_no_grammar_without_format_or_callable_tools():
    assert turn_grammar(TurnSpec()) is None
    assert turn_grammar(TurnSpec(tools=FUNCS, tool_choice="none")) is None
    assert turn_grammar(TurnSpec(tools=FUNCS, tool_choice="none", response_format=ResponseFormat("json_object")))


@pytest.mark.parametrize(
    "text",
    [
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}',
        '<|channel|>commentary to=functions.add<|constrain|>json<|message|>{"a":1,"b":2}',
        '<|channel|>commentary to=functions.add<|message|>{"a":1,"b":2}',
        ' to=functions.add<|channel|>commentary json<|message|>{"a":1,"b":2}',
        ' to=functions.add<|channel|>commentary <|constrain|>json<|message|>{"a":1,"b":2}',
        "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>commentary<|message|>On it.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}',
    ],
)
def test_every_header_the_grammar_allows_parses_as_the_call(text):
    run = Masked(grammar(TurnSpec(tools=FUNCS, tool_choice="required"), reasoning=None), random_logits(0))
    ids = encode_harmony(text)
    for token in ids:
        assert run.allowed()[token], text
        assert run.matcher.accept_token(token)
    assert run.allowed()[CALL] and run.allowed()[RETURN]
    assert items(ids + [CALL])[-1] == ("function_call", "add", '{"a":1,"b":2}')
