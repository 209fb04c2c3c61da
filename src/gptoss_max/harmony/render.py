"""A turn's settings and its history -> Harmony prompt token ids.

The system message carries the reasoning effort and date, the developer message the
instructions, function tools and response format. History is rendered with
`auto_drop_analysis=False`: which reasoning to drop is decided in `messages.py`.
What the reply must look like (a forced call, a JSON answer) is enforced while decoding,
by the grammar in `grammar.py`, not by prefilling the reply.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field

from openai_harmony import (
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    SystemContent,
    TextContent,
    ToolDescription,
)

from gptoss_max.harmony.messages import drop_finished_reasoning
from gptoss_max.tokenizer import harmony_encoding

END_OF_TEXT = 199999  # <|endoftext|>
RETURN = 200002  # <|return|>: the final answer is done
CALL = 200012  # <|call|>: a tool call is done
END = 200007  # <|end|>: one message is done, the turn goes on (never a stop token)
MESSAGE = 200008  # <|message|>: a header is done
START = 200006  # <|start|>: a message begins (its role follows)
CHANNEL = 200005  # <|channel|>
CONSTRAIN = 200003  # <|constrain|>: the content type (json) follows
STOP_TOKEN_IDS = (RETURN, CALL, END_OF_TEXT)

_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}
_NO_RENDER_DROP = RenderConversationConfig(auto_drop_analysis=False)


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict | None = None
    strict: bool = False  # arguments constrained to `parameters` (else: any JSON object)


@dataclass(frozen=True)
class ResponseFormat:
    """`kind` is "text", "json_object" or "json_schema" (which needs `name` and `schema`).

    A json_schema answer always follows its schema; `strict` makes a keyword that cannot be
    enforced an error instead of being left out."""

    kind: str = "text"
    name: str = "response"
    schema: dict | None = None
    description: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class TurnSpec:
    """What goes into the system and developer messages, and what the reply must be.

    `tool_choice` is "auto", "none", "required" or the name of the one function to call.
    """

    effort: str = "medium"
    date: str | None = None
    instructions: str | None = None
    tools: tuple[FunctionTool, ...] = ()
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    tool_choice: str = "auto"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]


def system_message(spec: TurnSpec) -> Message:
    date = spec.date or dt.datetime.now(dt.timezone.utc).date().isoformat()
    content = SystemContent.new().with_reasoning_effort(_EFFORTS[spec.effort]).with_conversation_start_date(date)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(spec: TurnSpec, extra: list[str]) -> Message | None:
    """Instructions (the request's, then leading system/developer input), tools, format."""
    parts = [p for p in [spec.instructions, *extra] if p]
    fmt = _format_section(spec.response_format)
    if fmt:
        parts.append(fmt)
    tools = [] if spec.tool_choice == "none" else list(spec.tools)
    if not parts and not tools:
        return None
    content = DeveloperContent.new()
    if parts:
        content = content.with_instructions("\n\n".join(parts))
    if tools:
        content = content.with_function_tools([ToolDescription.new(t.name, t.description, t.parameters) for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _format_section(fmt: ResponseFormat) -> str:
    if fmt.kind == "json_object":
        return "# Response Formats\n\nReply with a single JSON object and nothing else."
    if fmt.kind == "json_schema":
        desc = f"// {fmt.description}\n" if fmt.description else ""
        schema = json.dumps(fmt.schema, separators=(",", ":"))
        return f"# Response Formats\n\n## {fmt.name}\n\n{desc}{schema}"
    return ""


def _leading_instructions(history: list[Message]) -> tuple[list[Message], list[Message]]:
    """The system/developer messages before the first other message, and the rest."""
    for i, msg in enumerate(history):
        if msg.author.role not in (Role.SYSTEM, Role.DEVELOPER):
            return history[:i], history[i:]
    return history, []


def _split_leading_instructions(history: list[Message]) -> tuple[list[str], list[Message]]:
    """System/developer text before the first other message joins the developer message."""
    lead, rest = _leading_instructions(history)
    return [c.text for msg in lead for c in msg.content if isinstance(c, TextContent)], rest


def render_prompt(spec: TurnSpec, history: list[Message]) -> Prompt:
    """Header + history (finished turns' reasoning dropped) + `<|start|>assistant`."""
    extra, rest = _split_leading_instructions(history)
    header = [system_message(spec)]
    dev = developer_message(spec, extra)
    if dev is not None:
        header.append(dev)
    conv = Conversation.from_messages(header + drop_finished_reasoning(rest))
    enc = harmony_encoding()
    return Prompt(ids=enc.render_conversation_for_completion(conv, Role.ASSISTANT, _NO_RENDER_DROP))


def render_prompt_within(spec: TurnSpec, history: list[Message], max_tokens: int) -> tuple[Prompt, int]:
    """`render_prompt`, with the oldest turns dropped until the prompt is at most `max_tokens`
    (the Responses API's `truncation: "auto"`). A turn is a user message and all that follows it
    up to the next; instructions leading the history stay, and so does the last turn, even if the
    prompt is then still too long. Returns the prompt and how many messages were dropped."""
    lead, rest = _leading_instructions(history)
    cuts = [0] + [j for j, m in enumerate(rest) if j > 0 and m.author.role == Role.USER]
    for cut in cuts:
        prompt = render_prompt(spec, lead + rest[cut:])
        if len(prompt.ids) <= max_tokens or cut == cuts[-1]:
            return prompt, cut
    raise AssertionError("unreachable: the last cut always returns")


def encode_text(text: str) -> list[int]:
    """Plain text (special tokens spelled out stay text) -> token ids."""
    return harmony_encoding().encode(text, disallowed_special=())


def encode_harmony(text: str) -> list[int]:
    """Harmony text with special tokens spelled out -> token ids (scripts, tests)."""
    return harmony_encoding().encode(text, allowed_special="all")
