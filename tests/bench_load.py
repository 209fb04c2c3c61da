"""bench/load.py, imported for the tests (bench/ is scripts, not a package)."""

from __future__ import annotations

from script_loader import load_script

load = load_script("bench/load.py", "gptoss_bench_load")
