"""Generated Harmony token ids -> output items, from scripted token sequences."""

from gptoss_max.harmony.parse import (
    HarmonyStream,
    ItemDone,
    ItemStarted,
    TextDelta,
    parse_completion,
)
from gptoss_max.harmony.render import encode_harmony


def items(events):
    """[(kind, name/phase, text, complete)] from a list of parse events."""
    out, start, deltas = [], None, []
    for ev in events:
        if isinstance(ev, ItemStarted):
            start, deltas = ev, []
        elif isinstance(ev, TextDelta):
            deltas.append(ev.text)
        else:
            assert isinstance(ev, ItemDone)
            assert "".join(deltas) == ev.text, "deltas must add up to the final text"
            out.append((start.kind, start.name or start.phase, ev.text, ev.complete))
    return out


def parse(text, truncated=False):
    return items(parse_completion(encode_harmony(text), truncated=truncated))


def test_reasoning_then_final():
    got = parse(
        "<|channel|>analysis<|message|>User says hi. Reply.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
    )
    assert got == [
        ("reasoning", None, "User says hi. Reply.", True),
        ("message", "final_answer", "Hello! How can I help?", True),
    ]


def test_reasoning_preamble_then_function_call():
    got = parse(
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
    )
    assert got == [
        ("reasoning", None, "Need the weather.", True),
        ("message", "commentary", "Let me check.", True),
        ("function_call", "get_weather", '{"city":"Paris"}', True),
    ]


def test_two_parallel_calls_both_header_orders():
    got = parse(
        '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x":1}<|call|>'
        '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{"y":2}<|call|>'
    )
    assert got == [
        ("function_call", "a", '{"x":1}', True),
        ("function_call", "b", '{"y":2}', True),
    ]


def test_json_final():
    payload = '{"answer": 42, "unit": "none"}'
    got = parse(f"<|channel|>final<|message|>{payload}<|return|>")
    assert got == [("message", "final_answer", payload, True)]


def test_malformed_header_recovers_without_crashing():
    # a second <|channel|> inside the header: the text still comes out, nothing raises
    got = parse("<|channel|>analysis<|channel|>final<|message|>oops<|return|>")
    assert [g[2] for g in got] == ["oops"]
    # text after <|end|> with no <|start|>: the strict grammar refuses it; recovered as a message
    got = parse("<|channel|>final<|message|>a<|end|>garbage here<|return|>")
    assert got == [
        ("message", "final_answer", "a", True),
        ("message", "final_answer", "garbage here", True),
    ]


def test_refusal_without_channel_tokens_is_a_final_message():
    got = parse("I'm sorry, but I can't help with that.<|return|>")
    assert got == [("message", "final_answer", "I'm sorry, but I can't help with that.", True)]


def test_short_text_without_header_cut_off_is_kept_as_final():
    from gptoss_max.harmony.render import encode_text

    assert parse_completion([]) == []
    got = items(parse_completion(encode_text("just words, no header"), truncated=True))
    assert got == [("message", "final_answer", "just words, no header", False)]
    # a header that was cut off is not text
    assert items(parse_completion(encode_harmony("<|channel|>final"), truncated=True)) == []


def test_truncated_item_is_incomplete_and_kept_in_history():
    stream = HarmonyStream()
    events = stream.feed_all(encode_harmony("<|channel|>analysis<|message|>a long thou"))
    events += stream.finish(truncated=True)
    assert items(events) == [("reasoning", None, "a long thou", False)]
    assert [m.channel for m in stream.messages] == ["analysis"]


def test_endoftext_ends_the_stream_and_is_not_content():
    got = parse("<|channel|>final<|message|>done<|endoftext|>")
    assert got == [("message", "final_answer", "done", True)]


def test_non_assistant_messages_are_ignored():
    got = parse("<|channel|>final<|message|>hi<|end|><|start|>user<|message|>pretend user<|end|>")
    assert got == [("message", "final_answer", "hi", True)]


def test_stream_messages_render_back_as_history():
    stream = HarmonyStream()
    stream.feed_all(
        encode_harmony(
            "<|channel|>analysis<|message|>think<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
            "<|message|>{}<|call|>"
        )
    )
    stream.finish(truncated=False)
    msgs = stream.messages
    assert [(m.channel, m.recipient) for m in msgs] == [
        ("analysis", None),
        ("commentary", "functions.f"),
    ]
    assert stream.reasoning_tokens > 0


def test_deltas_stream_before_the_item_is_done():
    stream = HarmonyStream()
    seen = []
    for token in encode_harmony("<|channel|>final<|message|>one two three"):
        seen.extend(type(e).__name__ for e in stream.feed(token))
    assert seen[0] == "ItemStarted" and seen.count("TextDelta") >= 3
    assert "ItemDone" not in seen


def test_long_text_without_any_header_streams_as_plain_text():
    from gptoss_max.harmony.parse import MAX_HEADER_TOKENS
    from gptoss_max.harmony.render import encode_text

    text = "A model that never writes a channel header still gets its words out. " * 12
    ids = encode_text(text)
    assert len(ids) > 2 * MAX_HEADER_TOKENS
    stream, seen = HarmonyStream(), []
    for i, token in enumerate(ids):
        if stream.feed(token) and not seen:
            seen.append(i)
    assert seen == [MAX_HEADER_TOKENS], "streaming starts once the header is clearly not one"
    events = stream.feed_all(encode_harmony("<|start|>é<|return|>")) + stream.finish(False)
    got = items(parse_completion(ids + encode_harmony("<|start|>é<|return|>")))
    assert got == [("message", "final_answer", text + "é", True)]
    assert isinstance(events[-1], ItemDone) and events[-1].text == text + "é"
    assert [m.channel for m in stream.messages] == ["final"]
