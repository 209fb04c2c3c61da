"""Our MAX graph vs Hugging Face transformers' GptOssForCausalLM on the same tiny checkpoint.

Realistic sinks (N(3, 2)), window 128 < sequence, teacher-forced over a prefill step
and 90 decode steps. Everything runs in float32 on the CPU; thresholds are the issue's.
"""

from __future__ import annotations

import pytest

from gptoss_max.fidelity import compare, max_logits, reference_logits
from model_fixtures import FORCED, PROMPT, teacher_tokens, tiny_engine, tiny_root  # noqa: F401
from reporting import report

pytestmark = pytest.mark.slow
COS_MIN = {"bf16": 0.999, "mxfp4": 0.995}


def test_logits_match_transformers(tiny_engine, record_property):  # noqa: F811
    experts, model_dir, engine = tiny_engine
    ids = teacher_tokens()
    ours = max_logits(engine, ids[:PROMPT], ids[PROMPT:])
    ref = reference_logits(model_dir, ids)[PROMPT - 1 :]
    assert ours.shape == (FORCED + 1, 201088)
    prefill, decode, every = compare(ours[:1], ref[:1]), compare(ours[1:], ref[1:]), compare(ours, ref)
    for name, agreement in [("prefill", prefill), ("decode", decode), ("all", every)]:
        report("model fidelity", f"{experts} experts, {name}: {agreement}")
        record_property(f"{experts}_{name}", agreement.as_dict())
    assert every.cos_min >= COS_MIN[experts], str(every)
    assert every.cos_mean >= 0.9995, str(every)
    assert every.clear_steps >= FORCED // 2
    assert every.argmax_agree_clear == 1.0, str(every)


def test_greedy_generation_is_deterministic(tiny_engine):  # noqa: F811
    _, _, engine = tiny_engine
    prompt = teacher_tokens()[:40]
    first = list(engine.generate(prompt, 12))
    again = list(engine.generate(prompt, 12))
    assert len(first) >= 1 and first == again
