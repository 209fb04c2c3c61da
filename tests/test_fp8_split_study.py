"""scripts/fp8_split_study.py: the two facts behind the FP8 tensor-core decode proposal."""

from __future__ import annotations

import pytest
import torch

from script_loader import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("scripts/fp8_split_study.py", "fp8_split_study")


def test_e2m1_nibbles_are_e4m3_bytes_by_placement(study):
    assert study.placement_is_exact(torch)
    assert study.e4m3_byte(0b0111) == 0b00011100  # 6.0 -> 6 * 2^-6 = 0.09375
    assert study.e4m3_byte(0b1001) == 0b10000100  # -0.5 -> e4m3 subnormal -2^-7


def test_two_e4m3_parts_beat_bf16_activations(study):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 512, generator=gen, dtype=torch.float64) * 3.0
    w = torch.randn(256, 512, generator=gen, dtype=torch.float64)
    ref = x @ w.T

    def err(xq):
        return ((xq @ w.T - ref).norm() / ref.norm()).item()

    one, two = err(study.split_e4m3(torch, x, 1)), err(study.split_e4m3(torch, x, 2))
    bf16 = err(x.to(torch.bfloat16).double())
    assert one > bf16 > two  # one e4m3 part is too coarse; hi + lo beats bf16
    assert two < 1e-3


def test_synthetic_scales_fit_the_f16_decode_range(study):
    """The FP8-converter decode (bench/NOTES.md) keeps values f16-normal for E8M0 bytes 114..136:
    the synthetic 120b experts' bytes all fall inside."""
    w, scales = study.synthetic_gate_up(0)
    assert w.shape == (5760, 2880) and scales.shape == (5760, 90)
    assert 114 <= int(scales.min()) and int(scales.max()) <= 136
