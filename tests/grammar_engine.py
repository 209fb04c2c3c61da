"""Grammar-masked sampling in process, and an `Engine` built on it (no MAX graph).

Logits come from a function (random ones stand in for the tiny random model: noise that
only the grammar can make valid); each step is masked by the request's grammar, compiled
with MAX's own xgrammar over the real o200k_harmony vocabulary (tiktoken's byte strings,
Harmony's special tokens by id) with the stop tokens MAX's worker uses, as it does.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from gptoss_max.harmony.grammar import FIRST_SPECIAL, VOCAB_SIZE
from gptoss_max.harmony.render import CALL, END_OF_TEXT, RETURN
from gptoss_max.server.engine import Chunk, GenParams
from gptoss_max.tokenizer import O200K_FILE, harmony_encoding, never_utf8_ids, tiktoken_dir

STOPS = (RETURN, CALL, END_OF_TEXT)
Logits = Callable[[list[int]], np.ndarray]  # ids so far -> [VOCAB_SIZE] float32


@functools.cache
def vocab() -> list[bytes]:
    """Each id's bytes (a special token's: its name)."""
    lines = (tiktoken_dir() / O200K_FILE).read_text().split()
    out = [b""] * VOCAB_SIZE
    for token, rank in zip(lines[::2], lines[1::2], strict=True):
        out[int(rank)] = base64.b64decode(token)
    enc = harmony_encoding()
    for i in range(FIRST_SPECIAL, VOCAB_SIZE):
        out[i] = enc.decode([i]).encode()
    return out


@functools.cache
def compiler():
    from max._core import xgrammar

    # Harmony's specials, and the tokens holding a byte no UTF-8 text has, as MAX's worker marks them
    # (maxapi.mask_never_utf8_tokens)
    never = never_utf8_ids(dict(enumerate(vocab()[:FIRST_SPECIAL])))
    specials = sorted(never) + list(range(FIRST_SPECIAL, VOCAB_SIZE))
    info = xgrammar.TokenizerInfo(vocab(), xgrammar.VocabType.RAW, VOCAB_SIZE, list(STOPS), False, specials)
    return xgrammar.GrammarCompiler(info, 2, True, -1)


def random_logits(seed: int) -> Logits:
    rng = np.random.default_rng(seed)
    return lambda ids: rng.standard_normal(VOCAB_SIZE, dtype=np.float32)


class Masked:
    """Greedy decoding of `logits` under a grammar (or none): one token per `step`."""

    def __init__(self, grammar: str | None, logits: Logits):
        from max._core import xgrammar

        self.logits = logits
        self.ids: list[int] = []
        self.matcher = None if grammar is None else xgrammar.GrammarMatcher(compiler().compile_structural_tag(grammar))
        self._bitmask = np.full((1, (VOCAB_SIZE + 31) // 32), -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """[VOCAB_SIZE] bool: what the grammar lets through now."""
        if self.matcher is None:
            return np.ones(VOCAB_SIZE, dtype=bool)
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[:VOCAB_SIZE].astype(bool)

    def step(self) -> int:
        scores = np.where(self.allowed(), self.logits(self.ids), -np.inf)
        token = int(np.argmax(scores))
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise AssertionError(f"the grammar refused the token it allowed: {token}")
        self.ids.append(token)
        return token


def sample(grammar: str | None, logits: Logits, max_tokens: int) -> list[int]:
    """Ids until a stop token (included) or `max_tokens`."""
    run = Masked(grammar, logits)
    while len(run.ids) < max_tokens and run.step() not in STOPS:
        pass
    return run.ids


@dataclass
class GrammarEngine:
    """An `Engine` of random logits (seeded per request) under each request's grammar."""

    model_name: str = "gpt-oss-grammar"
    max_context: int = 8192
    chunk_size: int = 3
    seed: int = 0
    params: list[GenParams] = field(default_factory=list)

    async def generate(self, prompt_ids: list[int], params: GenParams) -> AsyncIterator[list[int]]:
        self.params.append(params)
        seed = params.seed if params.seed is not None else self.seed + len(self.params)
        run = Masked(params.grammar, random_logits(seed))
        chunk = Chunk()
        chunk.cached_tokens = 0
        while len(run.ids) < params.max_new_tokens:
            token = run.step()
            chunk.append(token)
            if token in params.stop_token_ids or len(chunk) == self.chunk_size:
                yield chunk
                chunk = Chunk()
                await asyncio.sleep(0)
            if token in params.stop_token_ids:
                return
        if chunk:
            yield chunk
