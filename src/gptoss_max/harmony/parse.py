"""Generated token ids -> output items, one token at a time.

`HarmonyStream` wraps openai-harmony's `StreamableParser` (non-strict) and turns its
state into three neutral events: an item starts (its kind is known once the header is
complete), its text grows, it is done. The Responses and chat layers shape these into
their own wire formats. Malformed output is recovered where the parser allows it: a
token the parser refuses starts a fresh parser, so text without a header still becomes
a message; only if that fails too does the stream stop with `error` set.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from openai_harmony import HarmonyError, Message, Role, StreamableParser

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.render import CALL, END, END_OF_TEXT, MESSAGE, RETURN
from gptoss_max.tokenizer import harmony_encoding

Kind = Literal["reasoning", "message", "function_call"]
_MESSAGE_ENDS = (END, RETURN, CALL)
# Real headers (`<|channel|>commentary to=functions.name <|constrain|>json`) are ~10-20 ids:
# a "header" longer than this is text without one, and is streamed as plain text instead.
MAX_HEADER_TOKENS = 64


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


class _PlainText:
    """Ids -> text with special tokens dropped, UTF-8 safe across token boundaries."""

    def __init__(self, enc) -> None:
        self._enc = enc
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: Iterable[int]) -> str:
        out = []
        for t in tokens:
            if not self._enc.is_special_token(t):
                raw = self._enc.decode([t], errors="surrogateescape")
                out.append(self._utf8.decode(raw.encode("utf-8", "surrogateescape")))
        return "".join(out)


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
        self._header: list[int] = []  # ids since the last message boundary, no item open
        self._plain: _PlainText | None = None  # set once output is taken as plain text

    def _new_parser(self) -> StreamableParser:
        return StreamableParser(self._enc, Role.ASSISTANT, strict=False)

    def feed(self, token: int) -> list[ParseEvent]:
        if self.finished or self.error:
            return []
        if token == END_OF_TEXT:
            return self.finish(truncated=False)
        if self._plain is not None:
            return self._feed_plain(token)
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
        if self._open is None and token not in _MESSAGE_ENDS:
            self._header.append(token)
            if len(self._header) > MAX_HEADER_TOKENS:
                events += self._go_plain()
        else:
            self._header = []
        return events

    def _go_plain(self) -> list[ParseEvent]:
        """No Harmony header in sight: the rest of the output is one plain final message."""
        self._plain = _PlainText(self._enc)
        text, self._header = self._plain(self._header), []
        start = ItemStarted("message", phase="final_answer")
        self._open = _Open(start, [text] if text else [])
        events: list[ParseEvent] = [start]
        return events + [TextDelta(text)] if text else events

    def _feed_plain(self, token: int) -> list[ParseEvent]:
        if token in (RETURN, CALL):
            return self.finish(truncated=False)
        text = self._plain([token]) if self._plain else ""
        if not text or self._open is None:
            return []
        self._open.text.append(text)
        return [TextDelta(text)]

    def feed_all(self, tokens: Iterable[int]) -> list[ParseEvent]:
        return [event for token in tokens for event in self.feed(token)]

    def finish(self, truncated: bool) -> list[ParseEvent]:
        """The generation ended: flush what the parser holds. `truncated`: out of tokens."""
        if self.finished:
            return []
        self.finished = True
        events: list[ParseEvent] = []
        if self._plain is None:
            try:
                self._parser.process_eos()
            except HarmonyError:
                pass  # an incomplete header: whatever text was open is closed below
            events = self._collect(complete=not truncated)
            if self._open is None and self._header and not any(map(self._enc.is_special_token, self._header)):
                events += self._go_plain()  # short text that never began a header: plain, as long text is
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
                self._open = _Open(start, [text])
                events += [start, TextDelta(text)]
            events += self._close(text, msg, complete)
        return events

    def _close(self, text: str, msg: Message | None, complete: bool) -> list[ParseEvent]:
        opened, self._open = self._open, None
        if opened is None or opened.start is None:
            return []
        if msg is None:
            msg = _message_for(opened.start, text)
        self.messages.append(msg)
        sent = "".join(opened.text)
        if text != sent and text.startswith(sent):  # held back until the end: an unfinished UTF-8 sequence
            return [TextDelta(text[len(sent) :]), ItemDone(text, complete)]
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
