"""scripts/kernel_asm.py builds sm_90a PTX of our GPU kernels on a machine without a GPU
(what kernel work between device sessions relies on)."""

from __future__ import annotations

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def asm():
    return load_script("scripts/kernel_asm.py", "kernel_asm")


def test_ptx_of_the_moe_and_attention_kernels(asm, tmp_path):
    specs = [
        "moe_gpu.gate_up_kernel[DType.bfloat16, 2]",
        "attention_gpu.attention_merge_kernel[DType.bfloat16, DType.float32, 64]",
    ]
    ptx = asm.build_ptx(specs, tmp_path)
    assert list(ptx) == specs
    gate_up, merge = ptx.values()
    assert ".target sm_90a" in gate_up and ".entry" in gate_up
    assert "mma.sync.aligned.m16n8k16" in gate_up  # tensor cores
    assert "ex2.approx" in merge and ".entry" in merge


def test_opcode_counts_read_predicated_sass(asm):
    sass = """
        /*0010*/                   HMMA.16816.F32.BF16 R44, R44, R48, R52 ;
        /*0020*/               @P5 LDG.E.128 R40, desc[UR10][R74.64+-0x100] ;
        /*0030*/              @!P0 BRA `(.L_x_2) ;
        /*0040*/                   HMMA.16816.F32.BF16 R40, R40, R48, R44 ;
    """
    assert asm.opcode_counts(sass) == {"HMMA": 2, "LDG": 1, "BRA": 1}
