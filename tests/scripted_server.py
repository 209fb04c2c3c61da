"""The server over a scripted engine, as its own process, served the way `gptoss-max serve` serves:
`shutdown.DrainingServer` and its signal handling (no model, so it starts in a second or two).

    python tests/scripted_server.py --port P --store PATH_OR_URL [--grace S] [--api-key K]

An input containing "long" gets a 100000-word answer, anything else `--words` words; each
chunk of 2 tokens takes `--delay` s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import uvicorn

from gptoss_max.server import shutdown
from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from gptoss_max.tokenizer import harmony_encoding


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--grace", type=float, default=3.0)
    p.add_argument("--words", type=int, default=100)
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    if args.api_key:
        os.environ["GPTOSS_MAX_API_KEY"] = args.api_key
    enc = harmony_encoding()

    def script(prompt_ids: list[int]) -> str:
        words = 100_000 if "long" in enc.decode(prompt_ids) else args.words
        return "<|channel|>final<|message|>" + " word" * words + "<|return|>"

    engine = ScriptedEngine(script, delay=args.delay)
    app = build_app(engine, args.store)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5)  # fmt: skip
    server = shutdown.DrainingServer(config, app.state.gptoss, args.grace)
    shutdown.install_exit_handler()
    asyncio.run(shutdown.serve(server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
