"""bench/load.py, imported for the tests (bench/ is scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "bench" / "load.py"
_spec = importlib.util.spec_from_file_location("gptoss_bench_load", _PATH)
assert _spec is not None and _spec.loader is not None
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load  # dataclasses look their module up
_spec.loader.exec_module(load)
