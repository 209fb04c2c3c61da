"""Turn grammars, compiled here once before they go to MAX's worker.

The worker compiles each grammar again against the real vocabulary; compiling it here
first, with xgrammar's converter over a placeholder vocabulary (~2 ms, no tokenizer), turns
a schema it cannot enforce into a 400 that names the parameter and says why, before any
token is generated. xgrammar is MAX's own copy (`max._core.xgrammar`, the C++ binding).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from gptoss_max.harmony.grammar import VOCAB_SIZE, json_value, turn_grammar
from gptoss_max.harmony.render import CALL, END_OF_TEXT, RETURN, TurnSpec
from gptoss_max.server.errors import bad_request

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[08:12:11] external/.../file.cc:6334: "


@functools.cache
def _compiler() -> Any:
    from max._core import xgrammar

    bytes_ = [bytes([i]) for i in range(256)]  # enough to spell any text; the rest stand for specials
    vocab = bytes_ + [b"\0"] * (VOCAB_SIZE - 256)
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, VOCAB_SIZE, [RETURN, CALL, END_OF_TEXT], False,
                                  list(range(256, VOCAB_SIZE)))  # fmt: skip
    return xgrammar.GrammarCompiler(info, 1, False, -1)


def _reason(exc: Exception) -> str:
    return _LOCATION.sub("", str(exc).strip())


def check_schema(schema: dict[str, Any], param: str, exact: bool, hint: str = "") -> None:
    """A 400 naming `param` if the schema cannot be compiled to a grammar."""
    fmt = json_value(schema, exact)
    try:
        _compiler().compile_json_schema(
            json.dumps(schema),
            any_whitespace=fmt["any_whitespace"],
            strict_mode=fmt["strict_mode"],
            reject_unsupported=exact,
            separators=tuple(fmt["separators"]),
        )
    except RuntimeError as exc:
        raise bad_request(
            f"The schema cannot be enforced while decoding: {_reason(exc)}{hint}.", param, "invalid_schema"
        ) from None


def for_turn(spec: TurnSpec, reasoning_tokens: int | None) -> str | None:
    """The turn's grammar as the JSON MAX takes, checked; None when nothing is constrained."""
    tag = turn_grammar(spec, reasoning_tokens)
    if tag is None:
        return None
    text = json.dumps(tag, separators=(",", ":"))
    try:
        _compiler().compile_structural_tag(text)
    except RuntimeError as exc:
        raise bad_request(
            f"The output constraints cannot be compiled: {_reason(exc)}.", code="invalid_schema"
        ) from None
    return text
