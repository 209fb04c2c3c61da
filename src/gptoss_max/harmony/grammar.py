"""A turn's output constraints as a token-level grammar: an xgrammar structural tag (JSON).

MAX's model worker masks every sampled token with it. Harmony's framing tokens
(`<|channel|>`, `<|message|>`, `<|end|>`, ...) are named by id, so they can never be
spelled out in plain text and the parser always sees real headers. Bodies are free text
(reasoning, preambles, plain answers: any non-special token) or JSON under a schema (the
response format, a strict function's parameters). A turn is: an optional reasoning
message, an optional preamble (when a function may be called), then the last message
(the final answer or a function call). The stop tokens (`<|return|>`, `<|call|>`) cannot
be named inside an xgrammar grammar: once the grammar is complete the matcher allows only
them, so they close the last message.
"""

from __future__ import annotations

from typing import Any

from gptoss_max.harmony.render import CHANNEL, CONSTRAIN, END, MESSAGE, START, FunctionTool, ResponseFormat, TurnSpec

FIRST_SPECIAL = 199998  # Harmony's special tokens are ids 199998..201087
VOCAB_SIZE = 201088
ANY_OBJECT: dict[str, Any] = {"type": "object"}

Format = dict[str, Any]


def _token(token_id: int) -> Format:
    return {"type": "token", "token": token_id}


def _text(value: str) -> Format:
    return {"type": "const_string", "value": value}


def _seq(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def _optional(content: Format) -> Format:
    return {"type": "optional", "content": content}


def _one_of(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def free_text(max_tokens: int | None) -> Format:
    """Any run of ordinary (non-special) tokens, at most `max_tokens` if given."""
    specials = list(range(FIRST_SPECIAL, VOCAB_SIZE))
    if max_tokens is None:
        return {"type": "any_tokens", "exclude_tokens": specials}
    one = {"type": "exclude_token", "exclude_tokens": specials}
    return {"type": "repeat", "min": 0, "max": max_tokens, "content": one}


def json_value(schema: dict[str, Any], exact: bool) -> Format:
    """Compact JSON valid under `schema`, without properties the schema does not name.

    `exact`: a keyword xgrammar cannot enforce is an error (otherwise it is enforced as far
    as it can be)."""
    return {
        "type": "json_schema",
        "json_schema": schema,
        "any_whitespace": False,
        "separators": [",", ":"],
        "strict_mode": True,
        "reject_unsupported": exact,
    }


def any_object() -> Format:
    """Any JSON object (what json_object and non-strict functions get)."""
    return {**json_value(ANY_OBJECT, exact=False), "strict_mode": False}


def _text_message(channel: str, max_tokens: int | None) -> Format:
    return _seq(_token(CHANNEL), _text(channel), _token(MESSAGE), free_text(max_tokens), _token(END))


def _json_tag() -> Format:
    """` <|constrain|>json` in a header (optional: the model may leave it out)."""
    return _optional(_seq(_optional(_text(" ")), _token(CONSTRAIN), _text("json")))


def final_message(fmt: ResponseFormat) -> Format:
    if fmt.kind == "text":
        return _seq(_token(CHANNEL), _text("final"), _token(MESSAGE), free_text(None))
    body = json_value(fmt.schema, fmt.strict) if fmt.kind == "json_schema" and fmt.schema is not None else any_object()
    return _seq(_token(CHANNEL), _text("final"), _json_tag(), _token(MESSAGE), body)


def arguments(tool: FunctionTool) -> Format:
    """A strict function's arguments follow its parameters schema; any other's are a JSON object."""
    if tool.strict and tool.parameters is not None:
        return json_value(tool.parameters, exact=True)
    return any_object()


def function_call(tool: FunctionTool) -> Format:
    """Both places gpt-oss puts a recipient: after the channel, or before it (in the role)."""
    recipient = f"to=functions.{tool.name}"
    body = arguments(tool)
    after_channel = _seq(_token(CHANNEL), _text(f"commentary {recipient}"), _json_tag(), _token(MESSAGE), body)
    in_role = _seq(
        _text(f" {recipient}"),
        _token(CHANNEL),
        _text("commentary"),
        _optional(_one_of(_text(" json"), _seq(_optional(_text(" ")), _token(CONSTRAIN), _text("json")))),
        _token(MESSAGE),
        body,
    )
    return _one_of(after_channel, in_role)


def _then_next_message(message: Format) -> Format:
    return _optional(_seq(message, _token(START), _text("assistant")))


def turn_grammar(spec: TurnSpec, reasoning_tokens: int | None = None) -> dict[str, Any] | None:
    """The structural tag for the reply to `spec` (it follows `<|start|>assistant`), or None
    when nothing is constrained (plain text, no callable function).

    `reasoning_tokens` caps each reasoning and preamble message (a tiny random model never
    ends one by itself)."""
    tools = () if spec.tool_choice == "none" else spec.tools
    if spec.response_format.kind == "text" and not tools:
        return None
    if spec.tool_choice == "required":
        last = [function_call(t) for t in tools]
    elif spec.tool_choice != "auto" and tools:
        last = [function_call(t) for t in tools if t.name == spec.tool_choice]
    else:
        last = [final_message(spec.response_format)] + [function_call(t) for t in tools]
    before = [_then_next_message(_text_message("analysis", reasoning_tokens))]
    if tools:
        before.append(_then_next_message(_text_message("commentary", reasoning_tokens)))
    return {"type": "structural_tag", "format": _seq(*before, _one_of(*last))}
