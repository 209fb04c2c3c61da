"""Harmony messages: built from Responses input items or chat messages, and pruned.

Input arrives as plain dicts already validated by the server's schemas; nothing here
knows about HTTP. Function-call outputs name their function through `calls`
(call_id -> function name), which the caller keeps across turns.
"""

from __future__ import annotations

from collections.abc import Iterable

from openai_harmony import Author, Conversation, Message, Role, TextContent

JSON_CONTENT_TYPE = "<|constrain|>json"


class HistoryError(ValueError):
    """Input that cannot become a Harmony conversation; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def user(text: str | list[str]) -> Message:
    return _with_texts(Role.USER, text)


def developer_text(text: str | list[str]) -> Message:
    return _with_texts(Role.DEVELOPER, text)


def assistant(text: str | list[str], channel: str = "final") -> Message:
    return _with_texts(Role.ASSISTANT, text).with_channel(channel)


def reasoning(text: str) -> Message:
    return assistant(text, "analysis")


def function_call(name: str, arguments: str) -> Message:
    return assistant(arguments, "commentary").with_recipient(f"functions.{name}").with_content_type(JSON_CONTENT_TYPE)


def function_output(name: str, output: str | list[str]) -> Message:
    msg = Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), "")
    msg.content = [TextContent(text=t) for t in _as_list(output)]
    return msg.with_channel("commentary").with_recipient("assistant")


def _as_list(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) else list(text) or [""]


def _with_texts(role: Role, text: str | list[str]) -> Message:
    return Message.from_role_and_contents(role, [TextContent(text=t) for t in _as_list(text)])


def content_texts(content: str | list[dict] | None) -> list[str]:
    """A message's `content` (a string or text parts) -> its texts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content]


def from_response_items(items: Iterable[dict], calls: dict[str, str]) -> list[Message]:
    """Responses API input items -> Harmony messages; records new function calls in `calls`."""
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_response_message(item))
        elif kind == "reasoning":
            texts = content_texts(item.get("content"))
            if texts:
                out.append(reasoning("\n".join(texts)))
        elif kind == "function_call":
            calls[item["call_id"]] = item["name"]
            out.append(function_call(item["name"], item["arguments"]))
        elif kind == "function_call_output":
            name = _called(calls, item["call_id"], f"input[{i}].call_id")
            out.append(function_output(name, content_texts(item["output"])))
        else:
            raise HistoryError(f"Unsupported input item type {kind!r}.", f"input[{i}].type")
    return out


def _response_message(item: dict) -> Message:
    texts = content_texts(item["content"])
    role = item["role"]
    if role in ("system", "developer"):
        return developer_text(texts)
    if role == "assistant":
        return assistant(texts, "commentary" if item.get("phase") == "commentary" else "final")
    return user(texts)


def _called(calls: dict[str, str], call_id: str, param: str) -> str:
    if call_id not in calls:
        raise HistoryError(f"No function call found for call_id {call_id!r}.", param)
    return calls[call_id]


def from_chat_messages(messages: Iterable[dict], calls: dict[str, str]) -> list[Message]:
    """Chat Completions messages -> Harmony messages (reasoning_content becomes analysis)."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        role, texts = m["role"], content_texts(m.get("content"))
        if role in ("system", "developer"):
            out.append(developer_text(texts))
        elif role == "user":
            out.append(user(texts))
        elif role == "tool":
            name = _called(calls, m["tool_call_id"], f"messages[{i}].tool_call_id")
            out.append(function_output(name, texts))
        else:
            out.extend(_chat_assistant(m, texts, calls))
    return out


def _chat_assistant(m: dict, texts: list[str], calls: dict[str, str]) -> list[Message]:
    out: list[Message] = []
    thought = m.get("reasoning_content") or m.get("reasoning")
    if thought:
        out.append(reasoning(thought))
    tool_calls = m.get("tool_calls") or []
    if any(texts):
        out.append(assistant(texts, "commentary" if tool_calls else "final"))
    for call in tool_calls:
        fn = call["function"]
        calls[call["id"]] = fn["name"]
        out.append(function_call(fn["name"], fn["arguments"]))
    return out


def drop_finished_reasoning(messages: list[Message]) -> list[Message]:
    """Drop the analysis of every turn that ended in a final answer.

    A turn runs from a user message to the next one. A turn still in a tool-call chain
    keeps its reasoning, as the model was trained to see it; tool calls always stay.
    """
    keep = [True] * len(messages)
    start = 0
    for end in [i for i, m in enumerate(messages) if m.author.role == Role.USER] + [len(messages)]:
        turn = [j for j in range(start, end) if messages[j].author.role == Role.ASSISTANT]
        if turn and messages[turn[-1]].channel == "final":
            for j in turn:
                if messages[j].channel == "analysis" and not messages[j].recipient:
                    keep[j] = False
        start = end
    return [m for m, k in zip(messages, keep, strict=True) if k]


def to_json(messages: list[Message]) -> str:
    return Conversation.from_messages(messages).to_json()


def from_json(payload: str) -> list[Message]:
    return list(Conversation.from_json(payload).messages)
