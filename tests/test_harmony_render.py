"""Requests and history -> Harmony prompt tokens."""

import pytest
from openai_harmony import Conversation, Role

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.render import (
    FunctionTool,
    ResponseFormat,
    TurnSpec,
    render_prompt,
    render_prompt_within,
)
from gptoss_max.tokenizer import harmony_encoding

WEATHER = FunctionTool(
    "get_weather",
    "Get the weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def text_of(prompt):
    return harmony_encoding().decode(prompt.ids)


def test_system_and_developer_messages():
    spec = TurnSpec(
        effort="high",
        date="2026-01-02",
        instructions="Be brief.",
        tools=(WEATHER,),
        response_format=ResponseFormat("json_schema", "answer", {"type": "object"}),
    )
    text = text_of(render_prompt(spec, [hm.user("Hi")]))
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Current date: 2026-01-02" in text and "Reasoning: high" in text
    dev = text.split("<|start|>developer<|message|>")[1].split("<|end|>")[0]
    assert dev.startswith("# Instructions\n\nBe brief.")
    assert '# Response Formats\n\n## answer\n\n{"type":"object"}' in dev
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in dev
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_no_developer_message_without_instructions_or_tools():
    text = text_of(render_prompt(TurnSpec(date="2026-01-02"), [hm.user("Hi")]))
    assert "<|start|>developer" not in text
    assert "Reasoning: medium" in text


def test_tool_choice_none_hides_tools_and_a_forced_call_is_not_prefilled():
    assert "get_weather" not in text_of(
        render_prompt(TurnSpec(tools=(WEATHER,), tool_choice="none"), [hm.user("x")])
    )
    for choice in ("get_weather", "required"):  # the grammar forces the call, after reasoning
        forced = render_prompt(TurnSpec(tools=(WEATHER,), tool_choice=choice), [hm.user("x")])
        assert text_of(forced).endswith("<|start|>user<|message|>x<|end|><|start|>assistant")


def test_every_response_input_item_maps():
    calls: dict[str, str] = {}
    items = [
        {"type": "message", "role": "developer", "content": "Speak French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {
            "type": "message",
            "role": "assistant",
            "phase": "commentary",
            "content": [{"type": "output_text", "text": "Checking."}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": '{"t":20}'},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "20 degrees."}],
        },
        {"type": "message", "role": "system", "content": "Now be terse."},
        {"type": "message", "role": "user", "content": "Thanks"},
    ]
    msgs = hm.from_response_items(items, calls)
    assert calls == {"c1": "get_weather"}
    text = text_of(render_prompt(TurnSpec(date="2026-01-02", tools=(WEATHER,)), msgs))
    body = text.split("} // namespace functions<|end|>")[1]
    assert body == (
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"t":20}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>20 degrees.<|end|>"
        "<|start|>developer<|message|>Now be terse.<|end|>"
        "<|start|>user<|message|>Thanks<|end|>"
        "<|start|>assistant"
    ), "the finished turn's reasoning is dropped, everything else kept in order"
    assert "# Instructions\n\nSpeak French." in text, "a leading developer message joins the header"


def test_tool_chain_in_progress_keeps_its_reasoning():
    calls: dict[str, str] = {}
    msgs = hm.from_response_items(
        [
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call it."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        calls,
    )
    assert "<|channel|>analysis<|message|>Call it.<|end|>" in text_of(
        render_prompt(TurnSpec(), msgs)
    )


def test_unknown_call_id_names_the_field():
    with pytest.raises(hm.HistoryError) as err:
        hm.from_response_items([{"type": "function_call_output", "call_id": "x", "output": ""}], {})
    assert err.value.param == "input[0].call_id"


def test_reasoning_of_every_finished_turn_is_dropped_unlike_harmony_auto_drop():
    history = [
        hm.user("one"),
        hm.reasoning("r1"),
        hm.assistant("a1"),
        hm.user("two"),
        hm.reasoning("r2"),
        hm.assistant("a2"),
        hm.user("three"),
    ]
    text = text_of(render_prompt(TurnSpec(), history))
    assert "r1" not in text and "r2" not in text and "a1" in text and "a2" in text
    # harmony 0.0.8's own auto-drop keeps r2: the reason this project drops reasoning itself
    enc = harmony_encoding()
    auto = enc.decode(
        enc.render_conversation_for_completion(Conversation.from_messages(history), Role.ASSISTANT)
    )
    assert "r1" not in auto and "r2" in auto


def test_chat_messages_map_reasoning_and_tool_calls():
    calls: dict[str, str] = {}
    msgs = hm.from_chat_messages(
        [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Call it.",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        ],
        calls,
    )
    assert [(m.author.role.value, m.channel, m.recipient) for m in msgs] == [
        ("developer", None, None),
        ("user", None, None),
        ("assistant", "analysis", None),
        ("assistant", "commentary", "functions.get_weather"),
        ("tool", "commentary", "assistant"),
    ]
    assert msgs[-1].author.name == "functions.get_weather"


def test_history_json_round_trip():
    msgs = [hm.user("a"), hm.function_call("f", "{}"), hm.function_output("f", "ok")]
    again = hm.from_json(hm.to_json(msgs))
    assert [m.to_dict() for m in again] == [m.to_dict() for m in msgs]


def test_truncation_drops_the_oldest_whole_turns_and_keeps_instructions():
    spec = TurnSpec(date="2026-01-02")
    history = [
        hm.developer_text("Answer in French."),
        hm.user("one " * 50),
        hm.assistant("un"),
        hm.user("two " * 50),
        hm.function_call("get_weather", '{"city": "Paris"}'),
        hm.function_output("get_weather", "20C"),
        hm.assistant("deux"),
        hm.user("three"),
    ]
    full = render_prompt(spec, history)
    prompt, dropped = render_prompt_within(spec, history, len(full.ids))
    assert (prompt.ids, dropped) == (full.ids, 0), "what fits is not touched"
    prompt, dropped = render_prompt_within(spec, history, len(full.ids) - 1)
    text = text_of(prompt)
    assert dropped == 2 and "one" not in text and "two two" in text and "Answer in French." in text
    assert prompt.ids == render_prompt(spec, [history[0], *history[3:]]).ids
    # the call and its output go with their turn, never one without the other
    prompt, dropped = render_prompt_within(spec, history, len(prompt.ids) - 1)
    text = text_of(prompt)
    assert dropped == 6 and "two" not in text and "20C" not in text and text.endswith("three<|end|><|start|>assistant")
    # the last turn always stays, even when it alone is too long
    prompt, dropped = render_prompt_within(spec, history, 1)
    assert dropped == 6 and "three" in text_of(prompt)
