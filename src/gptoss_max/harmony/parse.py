"""Generated token ids -> output items, one token at a time.

`HarmonyStream` wraps openai-harmony's `StreamableParser` (non-strict) and turns its
state into three neutral events: an item starts (its kind is known once the header is
complete), its text grows, it is done. The Responses and chat layers shape these into
their own wire formats. Malformed output is recovered where the parser allows it: a
token the parser refuses starts a fresh parser, so text without a header still becomes
a message; only if that fails too does the stream stop with `error` set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from openai_harmony import HarmonyError, Message, Role, StreamableParser

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.render import CALL, END, END_OF_TEXT, MESSAGE, RETURN
from gptoss_max.tokenizer import harmony_encoding

Kind = Literal["reasoning", "message", "function_call"]
_MESSAGE_ENDS = (END, RETURN, CALL)


@dataclass(frozen=True)
class ItemStarted:
    kind: Kind
    name: str | None = None  # function name, for function calls
    phase: str | None = None  # "commentary" (a preamble) or "final_answer", for messages


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ItemDone:
    text: str
    complete: bool  # False when generation stopped inside this item


ParseEvent = ItemStarted | TextDelta | ItemDone


def classify(channel: str | None, recipient: str | None) -> ItemStarted:
    """Where a Harmony message goes in the output."""
    if recipient and recipient.startswith("functions."):
        return ItemStarted("function_call", name=recipient.removeprefix("functions."))
    if channel == "analysis":
        return ItemStarted("reasoning")
    return ItemStarted("message", phase="commentary" if channel == "commentary" else "final_answer")


@dataclass
class _Open:
    start: ItemStarted | None  # None: a non-assistant message, followed silently
    text: list[str] = field(default_factory=list)


class HarmonyStream:
    """Feed generated ids with `feed`, then call `finish` once; read `messages` for history."""

    def __init__(self) -> None:
        self._enc = harmony_encoding()
        self._parser = self._new_parser()
        self._seen = 0  # messages of the current parser already handed out
        self._open: _Open | None = None
        self.messages: list[Message] = []  # completed assistant messages, in order
        self.error: str | None = None
        self.reasoning_tokens = 0
        self.finished = False

    def _new_parser(self) -> StreamableParser:
        return StreamableParser(self._enc, Role.ASSISTANT, strict=False)

    def feed(self, token: int) -> list[ParseEvent]:
        if self.finished or self.error:
            return []
        if token == END_OF_TEXT:
            return self.finish(truncated=False)
        events: list[ParseEvent] = []
        try:
            self._parser.process(token)
        except HarmonyError:
            events += self._restart(token)
            if self.error:
                return events
        if self._open and self._open.start and self._open.start.kind == "reasoning":
            self.reasoning_tokens += 1
        if token == MESSAGE and self._open is None:
            events += self._start()
        delta = self._parser.last_content_delta
        if delta:
            if self._open is None:
                events += self._start()
            self._open.text.append(delta)  # type: ignore[union-attr]
            if self._open.start:  # type: ignore[union-attr]
                events.append(TextDelta(delta))
        if token in _MESSAGE_ENDS:
            events += self._collect(complete=True)
        return events

    def feed_all(self, tokens: Iterable[int]) -> list[ParseEvent]:
        return [event for token in tokens for event in self.feed(token)]

    def finish(self, truncated: bool) -> list[ParseEvent]:
        """The generation ended: flush what the parser holds. `truncated`: out of tokens."""
        if self.finished:
            return []
        self.finished = True
        try:
            self._parser.process_eos()
        except HarmonyError:
            pass  # an incomplete header: whatever text was open is closed below
        events = self._collect(complete=not truncated)
        if self._open is not None:
            events += self._close("".join(self._open.text), None, complete=not truncated)
        return events

    def _restart(self, token: int) -> list[ParseEvent]:
        """The parser refused `token`: keep what it finished, re-parse from `token` on."""
        events = self._collect(complete=True)
        if self._open is not None:
            events += self._close("".join(self._open.text), None, complete=False)
        self._parser, self._seen = self._new_parser(), 0
        try:
            self._parser.process(token)
        except HarmonyError as exc:
            self.error = f"malformed Harmony output from the model: {exc}"
        return events

    def _start(self) -> list[ParseEvent]:
        role = self._parser.current_role
        if role not in (None, Role.ASSISTANT):
            self._open = _Open(None)
            return []
        start = classify(self._parser.current_channel, self._parser.current_recipient)
        self._open = _Open(start)
        return [start]

    def _collect(self, complete: bool) -> list[ParseEvent]:
        """Hand out the messages the parser finished since last time."""
        done = self._parser.messages[self._seen :]
        self._seen += len(done)
        events: list[ParseEvent] = []
        for msg in done:
            text = "".join(c.text for c in msg.content if hasattr(c, "text"))
            if self._open is None:  # finished without a header (e.g. bare text)
                if msg.author.role != Role.ASSISTANT or not text:
                    continue
                start = classify(msg.channel, msg.recipient)
                self._open = _Open(start)
                events += [start] + ([TextDelta(text)] if text else [])
            events += self._close(text, msg, complete)
        return events

    def _close(self, text: str, msg: Message | None, complete: bool) -> list[ParseEvent]:
        opened, self._open = self._open, None
        if opened is None or opened.start is None:
            return []
        if msg is None:
            msg = _message_for(opened.start, text)
        self.messages.append(msg)
        return [ItemDone(text, complete)]


def _message_for(start: ItemStarted, text: str) -> Message:
    """A Harmony message for an item the parser never finished (for the stored history)."""
    if start.kind == "function_call":
        return hm.function_call(start.name or "", text)
    if start.kind == "reasoning":
        return hm.reasoning(text)
    return hm.assistant(text, "commentary" if start.phase == "commentary" else "final")


def parse_completion(ids: Iterable[int], truncated: bool = False) -> list[ParseEvent]:
    """All events for a finished list of generated ids (tests, non-streaming helpers)."""
    stream = HarmonyStream()
    return stream.feed_all(ids) + stream.finish(truncated)
