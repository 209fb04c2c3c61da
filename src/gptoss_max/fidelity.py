"""Teacher-forced logits from our MAX pipeline vs an independent reference (transformers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORCE_LOGIT = 1e4


class TeacherForcing:
    """A MAX logits processor: record each step's next-token logits, then force the given token."""

    def __init__(self, forced: list[int]):
        self.forced = list(forced)
        self.steps: list[np.ndarray] = []
        self._pending: Any = None

    def __call__(self, inputs: Any) -> None:
        from max.driver import CPU

        host = inputs.logits.to(CPU())  # the same buffer when the logits live on the CPU
        logits = np.from_dlpack(host)  # [N, V] float32, N = logits returned this step
        self.steps.append(np.array(logits[-1], dtype=np.float32))
        if len(self.steps) <= len(self.forced):
            logits[-1, :] = -FORCE_LOGIT
            logits[-1, self.forced[len(self.steps) - 1]] = FORCE_LOGIT
            if not inputs.logits.device.is_host:
                inputs.logits.inplace_copy_from(host)
                self._pending = host  # the copy may still read it after we return


def max_logits(engine: Any, prompt: list[int], forced: list[int]) -> np.ndarray:
    """Logits predicting positions len(prompt) .. len(prompt)+len(forced): prefill step + decode steps."""
    from gptoss_max import maxapi

    tf = TeacherForcing(forced)
    params = maxapi.SamplingParams(
        top_k=1, max_new_tokens=len(forced) + 1, ignore_eos=True, detokenize=False, logits_processors=[tf]
    )
    generated = list(engine.run(prompt, params))
    if generated[: len(forced)] != forced:
        raise AssertionError(f"teacher forcing failed: generated {generated[:8]}..., forced {forced[:8]}...")
    return np.stack(tf.steps[: len(forced) + 1])


def reference_logits(model_dir: Path, ids: list[int], device: str = "cpu", dtype: str = "float32") -> np.ndarray:
    """transformers' GptOssForCausalLM (MXFP4 experts dequantized exactly), float32 unless
    `dtype="bfloat16"` (the bf16 noise floor of a checkpoint): [len(ids), V]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).float()
    model = model.to(device=device, dtype=getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device)).logits[0]
    return out.float().cpu().numpy()


@dataclass(frozen=True)
class Agreement:
    steps: int
    cos_min: float
    cos_mean: float
    clear_steps: int
    argmax_agree_clear: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"steps={self.steps} cos_min={self.cos_min:.6f} cos_mean={self.cos_mean:.6f} "
            f"argmax_agree={self.argmax_agree_clear:.4f} over {self.clear_steps} steps with margin>0.05"
        )


def compare(ours: np.ndarray, ref: np.ndarray, margin: float = 0.05) -> Agreement:
    """Per-step cosine, and argmax agreement where the reference's top-2 margin > `margin`."""
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    top2 = np.sort(b, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > margin
    agree = a.argmax(-1) == b.argmax(-1)
    return Agreement(
        steps=len(cos),
        cos_min=float(cos.min()),
        cos_mean=float(cos.mean()),
        clear_steps=int(clear.sum()),
        argmax_agree_clear=float(agree[clear].mean()) if clear.any() else float("nan"),
    )
