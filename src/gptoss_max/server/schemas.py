"""Request bodies, validated strictly: a wrong type or an unknown field is a 400 naming it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    Tag,
    ValidationError,
    WithJsonSchema,
)

from gptoss_max.server.errors import APIError, bad_request

ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _is(value: object) -> AfterValidator:
    def check(v: object) -> object:
        if v != value:
            raise ValueError(f"Input should be {json.dumps(value)}")
        return v

    return AfterValidator(check)


# One accepted value, of its JSON type: pydantic's Literal[False] takes 0, and Literal[1] takes true.
OnlyFalse = Annotated[StrictBool, _is(False), WithJsonSchema({"type": "boolean", "const": False})]
OnlyOne = Annotated[StrictInt, _is(1), WithJsonSchema({"type": "integer", "const": 1})]

# A chat completion's stop sequence (up to 4 of them, as OpenAI takes).
StopSequence = Annotated[str, StringConstraints(min_length=1)]

# OpenAI's limits on `metadata`: up to 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # echoed output_text parts carry these
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # never issued by this server
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: ToolName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


def _item_tag(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_tag),
]


class FunctionToolParam(Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: ToolName


class Reasoning(Strict):
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; none is produced


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionToolParam] = []
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: Metadata | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns go when the input is too long
    # Accepted without effect: identifiers and hints that change nothing here.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: OnlyFalse | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a create request's body, with `model` and `input` optional."""

    model: str | None = None  # type: ignore[assignment]  # optional here: the served model
    input: str | list[InputItem] = []


class ChatFunction(Strict):
    name: ToolName
    arguments: str


class ChatToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class ChatFunctionDef(Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: ChatFunctionDef


class NamedFunctionName(Strict):
    name: ToolName


class ChatNamedChoice(Strict):
    type: Literal["function"]
    function: NamedFunctionName


class ChatJsonSchema(Strict):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ChatResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: ChatJsonSchema | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class ChatRequest(Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ChatNamedChoice = "auto"
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    response_format: ChatResponseFormat | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    n: OnlyOne = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: Metadata | None = None
    user: str | None = None
    store: OnlyFalse | None = None
    # Sent as defaults by many clients: accepted at their no-op values only.
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logprobs: OnlyFalse | None = None
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=4)] | None = None  # on `content` only


_TAGS = ("message", "reasoning", "function_call", "function_call_output")


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a parameter path, without union-branch labels."""
    out, prev = "", None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(prev, int) and part in _TAGS:
            pass  # the discriminator tag of a list item
        elif part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool"):
            pass  # the name of a union branch
        else:
            out += f".{part}" if out else part
        prev = part
    return out


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    unknown = [_where(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        return bad_request(
            f"Unsupported parameter(s): {names}.", unknown[0], "unsupported_parameter"
        )
    first = max(errors, key=lambda e: len(e["loc"]))  # the deepest: the branch that nearly fit
    where = _where(first["loc"]) or None
    if first["type"] == "union_tag_invalid":
        ctx = first["ctx"]
        msg = f"Unsupported type {ctx['tag']!r} at {where!r}; supported: {ctx['expected_tags']}."
        return bad_request(msg, where, "unsupported_type")
    if first["type"] == "missing":
        return bad_request(
            f"Missing required parameter: {where!r}.", where, "missing_required_parameter"
        )
    return bad_request(f"Invalid value for {where!r}: {first['msg']}.", where, "invalid_value")


Model = TypeVar("Model", bound=BaseModel)


def parse_request(model: type[Model], body: dict[str, Any]) -> Model:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
