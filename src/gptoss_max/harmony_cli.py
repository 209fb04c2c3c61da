"""The minimal Harmony rendering/parsing `gptoss-max generate` needs (the server has the full one)."""

from __future__ import annotations

import datetime

from gptoss_max.tokenizer import harmony_encoding


def render_prompt(prompt: str, effort: str = "medium") -> list[int]:
    from openai_harmony import Conversation, Message, ReasoningEffort, Role, SystemContent

    system = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(datetime.date.today().isoformat())
    )
    conv = Conversation.from_messages(
        [Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.USER, prompt)]
    )
    return list(harmony_encoding().render_conversation_for_completion(conv, Role.ASSISTANT))


def parse_completion(tokens: list[int]) -> list[tuple[str, str]]:
    """(channel, text) per parsed message; unparseable output comes back raw, as `raw`."""
    from openai_harmony import Role, StreamableParser

    enc = harmony_encoding()
    parser = StreamableParser(enc, Role.ASSISTANT, strict=False)
    try:
        for tok in tokens:
            parser.process(tok)
        parser.process_eos()
        msgs = [(m.channel or "final", "".join(c.text for c in m.content)) for m in parser.messages]
        if parser.current_content:
            msgs.append((parser.current_channel or "final", parser.current_content))
        return msgs or [("raw", enc.decode(tokens))]
    except Exception:  # the model's output need not be valid Harmony
        return [("raw", enc.decode(tokens))]
