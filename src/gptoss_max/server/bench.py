"""GET /bench: a quick decode probe through the live engine (off unless --enable-bench)."""

from __future__ import annotations

import asyncio
import time

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.render import TurnSpec, render_prompt
from gptoss_max.server.engine import Engine, GenParams
from gptoss_max.server.errors import bad_request

PROMPT = "Write a long story about a lighthouse keeper."


async def _one(
    engine: Engine, prompt: list[int], params: GenParams, t0: float
) -> tuple[float, int]:
    first, count = None, 0
    async for chunk in engine.generate(prompt, params):
        first = first or time.perf_counter() - t0
        count += len(chunk)
    return first or 0.0, count


async def run_bench(engine: Engine, n: int, max_new_tokens: int, temperature: float = 1.0) -> dict:
    """`n` concurrent requests, each decoding exactly `max_new_tokens` (stop tokens ignored), sampled
    at `temperature` (0: greedy, which MAX samples by another path)."""
    if not 1 <= n <= 256:
        raise bad_request("n must be between 1 and 256.", "n")
    if not 1 <= max_new_tokens <= 8192:
        raise bad_request("max_new_tokens must be between 1 and 8192.", "max_new_tokens")
    if not 0 <= temperature <= 2:
        raise bad_request("temperature must be between 0 and 2.", "temperature")
    prompt = render_prompt(TurnSpec(effort="low"), [hm.user(PROMPT)]).ids
    params = GenParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_one(engine, prompt, params, t0) for _ in range(n)])
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    decode = wall - max(ttfts)
    return {
        "model": engine.model_name,
        "n": n,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "prompt_tokens": len(prompt),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "ttft_s_mean": round(sum(ttfts) / n, 4),
        "ttft_s_max": round(max(ttfts), 4),
        "tok_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "decode_tok_per_s_per_seq": round((max_new_tokens - 1) / decode, 2)
        if decode > 0 and max_new_tokens > 1
        else None,
    }
