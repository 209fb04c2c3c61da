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


# ---------------------------------------------------------------------------------------------
# Full-size reference without files: transformers' GptOssForCausalLM built in memory from a
# synthetic model's weights, bf16 on the device (a 20b is ~42 GB); a float32 forward upcasts one
# decoder layer at a time (bf16 and dequantized MXFP4 values are exact in float32), so it equals
# transformers' float32 run of the same checkpoint without holding 84 GB.


def mxfp4_dequantize(blocks: Any, scales: Any) -> Any:
    """torch: `blocks [..., nb, 16] u8`, `scales [..., nb] u8` -> float32 `[..., nb * 32]`
    (the same values as `mxfp4.decode`; on whatever device the tensors are)."""
    import torch

    from gptoss_max import mxfp4

    lut = torch.tensor(mxfp4.E2M1_VALUES, device=blocks.device)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    vals = vals.reshape(*blocks.shape[:-1], mxfp4.BLOCK)
    vals = vals * torch.exp2(scales.to(torch.float32) - mxfp4.E8M0_BIAS)[..., None]
    return vals.reshape(*scales.shape[:-1], scales.shape[-1] * mxfp4.BLOCK)


def synthetic_reference(model: Any, device: str = "cpu", threads: int | None = None) -> Any:
    """transformers' GptOssForCausalLM holding `model`'s (a `SyntheticModel`) weights in bf16 on
    `device`, generated layer by layer (host RAM: one layer). MXFP4 experts are dequantized as
    transformers dequantizes them (decode, then [E, out, in] -> [E, in, out]); eager attention."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from gptoss_max.synthetic import generate_arrays, tensor_plans

    spec = model.spec
    config = GptOssConfig.from_dict(spec.to_hf(mxfp4_experts=False))
    config._attn_implementation = "eager"
    with torch.device("meta"):
        ref = GptOssForCausalLM(config)
    plans = tensor_plans(spec, model.mxfp4_experts)
    groups: dict[str, list[Any]] = {}
    for p in plans:
        key = p.name.split(".")[2] if p.name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(p)
    state: dict[str, Any] = {}
    for group in groups.values():
        arrays = generate_arrays(spec, model.seed, model.mxfp4_experts, threads, progress=False, plans=group)
        for name, (arr, dtype) in arrays.items():
            if dtype == "BF16":  # bit patterns; int16 is the 2-byte integer torch supports everywhere
                state[name] = torch.from_numpy(arr.view(np.int16)).to(device).view(torch.bfloat16)
            elif name.endswith("_blocks"):
                t = torch.from_numpy(arr).to(device)
                scales = torch.from_numpy(arrays[name.replace("_blocks", "_scales")][0]).to(device)
                dense = mxfp4_dequantize(t, scales).to(torch.bfloat16)
                state[name.replace("_blocks", "")] = dense.transpose(1, 2).contiguous()
        del arrays
    ref.load_state_dict(state, strict=True, assign=True)
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=config, device=device)
    left = [n for n, t in [*ref.named_parameters(), *ref.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"reference tensors never loaded: {left[:5]}")
    return ref.eval()


def reference_forward(
    ref: Any, ids: list[int], dtype: str = "float32", router_logits: bool = False
) -> tuple[np.ndarray, ...]:
    """Logits `[len(ids), V]` of a bf16 reference run in `dtype` (float32 / tensorfloat32 (float32
    with TF32 matmuls) / float64: decoder layers
    upcast one at a time, embeddings, norm and LM head for the run; float64 runs transformers'
    eager experts, its grouped matmul has no float64), and the router's top-k expert ids
    `[layers, len(ids), k]`; with `router_logits`, also the router's logits `[layers, len(ids), E]`
    (float64). Logits come back float64 from a float64 run, float32 otherwise."""
    import torch

    device = next(ref.parameters()).device
    routed: list[Any] = []
    scores: list[Any] = []
    hooks = []
    outer = (ref.model.embed_tokens, ref.model.norm, ref.lm_head)
    impl = getattr(ref.config, "_experts_implementation", None)
    if dtype in ("float32", "tensorfloat32", "float64"):
        wide = torch.float64 if dtype == "float64" else torch.float32
        tf32 = dtype == "tensorfloat32"  # float32 with TF32 matmuls, as MAX's GPU float32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        for module in outer:
            module.to(wide)
        if dtype == "float64":
            ref.config._experts_implementation = "eager"
        for layer in ref.model.layers:
            saved: dict[str, Any] = {}

            def upcast(mod: Any, _args: Any, saved: dict[str, Any] = saved, wide: Any = wide) -> None:
                for name, p in mod.named_parameters():
                    saved[name] = p.data
                    p.data = p.data.to(wide)

            def restore(mod: Any, _args: Any, _out: Any, saved: dict[str, Any] = saved) -> None:
                for name, p in mod.named_parameters():
                    p.data = saved.pop(name)

            hooks += [layer.register_forward_pre_hook(upcast), layer.register_forward_hook(restore)]
    elif dtype != "bfloat16":
        raise ValueError(f"dtype must be float64, float32, tensorfloat32 or bfloat16, not {dtype!r}")

    def record(_m: Any, _a: Any, out: Any) -> None:
        routed.append(out[2].cpu())
        if router_logits:
            scores.append(out[0].detach().to(torch.float64).cpu())

    for layer in ref.model.layers:
        hooks.append(layer.mlp.router.register_forward_hook(record))
    try:
        with torch.no_grad():
            logits = ref(torch.tensor([ids], device=device)).logits[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        for h in hooks:
            h.remove()
        if impl is not None:
            ref.config._experts_implementation = impl
        for module in outer:
            module.to(torch.bfloat16)  # exact: their values came from bf16
    out_dtype = torch.float64 if dtype == "float64" else torch.float32
    result = (logits.to(out_dtype).cpu().numpy(), torch.stack(routed).numpy())
    return (*result, torch.stack(scores).numpy()) if router_logits else result


def routing_balance(expert_ids: np.ndarray, experts: int) -> dict[str, float]:
    """Per-layer spread of tokens over experts from `[layers, tokens, k]` top-k ids: the worst
    layer's share of experts used, max/mean load, and load entropy / log(experts)."""
    used, peak, entropy = [], [], []
    for layer in expert_ids:
        load = np.bincount(layer.reshape(-1), minlength=experts).astype(np.float64)
        p = load / load.sum()
        used.append(float((load > 0).mean()))
        peak.append(float(load.max() / load.mean()))
        entropy.append(float(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(experts)))
    return {"experts_used_min": min(used), "max_over_mean_load_max": max(peak), "entropy_min": min(entropy)}


def route_changes(expert_ids: np.ndarray, base_ids: np.ndarray) -> np.ndarray:
    """Per layer, the fraction of tokens whose top-k expert set differs from `base_ids`'s
    (both `[layers, tokens, k]`): how many routing decisions a precision change flips."""
    a, b = np.sort(expert_ids, axis=-1), np.sort(base_ids, axis=-1)
    return (a != b).any(axis=-1).mean(axis=-1)


def topk_gaps(router_logits: np.ndarray, k: int) -> np.ndarray:
    """`[layers, tokens]`: the k-th minus the (k+1)-th largest router logit, the margin a
    perturbation of the router logits must cross to change a token's expert set."""
    top = np.sort(router_logits, axis=-1)[..., -(k + 1) :]
    return top[..., 1] - top[..., 0]


def precision_sensitivity(ref: Any, ids: list[int], dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """The same reference run in float64 and in each of `dtypes`, compared with float64: logit
    agreement (`compare`), per-layer fraction of tokens whose top-k experts change, and median
    |router logit error| per layer; plus the float64 run's top-k gaps (k-th vs (k+1)-th logit)."""
    k = ref.config.num_experts_per_tok
    base, base_ids, base_rl = reference_forward(ref, ids, "float64", router_logits=True)
    gaps = topk_gaps(base_rl, k)
    out: dict[str, Any] = {
        "router_logit_std": float(base_rl.std()),
        "gap_median": float(np.median(gaps)),
        "gap_below_0.01": float((gaps < 0.01).mean()),
        "rows": {},
    }
    for dtype in dtypes:
        logits, expert_ids, rl = reference_forward(ref, ids, dtype, router_logits=True)
        out["rows"][dtype] = {
            **compare(logits, base).as_dict(),
            "route_changes": route_changes(expert_ids, base_ids).tolist(),
            "router_err_median": np.median(np.abs(rl - base_rl), axis=(1, 2)).tolist(),
        }
    return out
