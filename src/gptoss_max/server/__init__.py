"""The HTTP server: Responses API, Harmony-correct chat completions, response store.

Depends on `gptoss_max.harmony` for everything Harmony; MAX only in max_engine.py and cli.py.
"""
