"""Tiny checkpoints and one compiled engine per expert format, shared by the whole session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gptoss_max.config import PRESETS

WINDOW = 128  # gpt-oss's own window: smaller than the teacher-forced sequence below
PROMPT, FORCED = 150, 90  # 240 tokens: prefill past the window, then decode steps


def tiny_dir(root: Path, experts: str) -> Path:
    from gptoss_max.synthetic import write_checkpoint

    return write_checkpoint(root / experts, PRESETS["tiny"].with_(sliding_window=WINDOW), 1, experts == "mxfp4")


def teacher_tokens() -> list[int]:
    rng = np.random.default_rng(7)
    return [int(x) for x in rng.integers(0, 199_990, size=PROMPT + FORCED)]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session", params=["mxfp4", "bf16"])
def tiny_engine(request, tiny_root):
    from gptoss_max.engine import Engine, EngineOptions

    model_dir = tiny_dir(tiny_root, request.param)
    engine = Engine(EngineOptions(model=str(model_dir), device="cpu", max_batch_size=2, max_length=1024))
    return request.param, model_dir, engine
