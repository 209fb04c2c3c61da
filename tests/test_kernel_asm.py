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
        "moe_gpu.gate_up_kernel[DType.bfloat16, 2, True]",
        "moe_gpu.gate_up_kernel[DType.bfloat16, 4, False]",
        "moe_gpu.down_one_token_kernel[DType.bfloat16]",
        "gemv.gemv_kernel[2, 16, True]",
        "router_decode.router_decode_kernel[3, 12, 4]",
        "attention_gpu.attention_merge_kernel[DType.bfloat16, DType.float32, 64]",
        "attention_gpu.attention_tc_kernel[DType.bfloat16, 4]",
        "attention_gpu.attention_tc_kernel[DType.bfloat16, 8]",
        "moe_gpu.gate_up_kernel[DType.bfloat16, 2, True, 4]",
        "attention_gpu.attention_tc_kernel[DType.bfloat16, 4, True, DType.bfloat16]",
        "gemv.skinny_kernel[8, 8]",
        "router_decode.router_decode_kernel[1, 12, 8]",
        "router_decode.add_norm_kernel",
        "moe_gpu.gate_up_lean_kernel[4]",
        "moe_gpu.down_kernel[DType.bfloat16, 4, 1]",
        "router_decode.router_decode_stream_kernel[12, 8, 1]",
        "moe_gpu.down_one_token_kernel[DType.bfloat16, 4]",
        "moe_gpu.down_one_token_kernel[DType.float32]",
    ]
    ptx = asm.build_ptx(specs, tmp_path)
    assert list(ptx) == specs
    (
        gate_up1,
        gate_up,
        down1,
        gemv,
        router,
        merge,
        tc4,
        tc8,
        routed,
        tc_rope,
        skinny,
        qkv_head,
        add_norm,
        lean,
        down,
        stream,
        down1_routed,
        down1_f32,
    ) = ptx.values()
    # the multi-token down's last block (v19): after its counter increment, a round's 8 x 4 partial
    # loads are all issued before the first add (they used to wait one after another)
    tail = down[down.index("atom.") :]
    assert tail[: tail.index("add.f32")].count("ld.volatile.global") == 32
    # the lean one-token gate_up (v18): LEAN_KS = 2 warps per tile, held to 22 warps per SM, its x
    # from shared memory, the warps' fragments summed behind a barrier, the top-k taken as above
    assert ".maxntid 64" in lean and ".minnctapersm 11" in lean
    assert "mma.sync.aligned.m16n8k16" in lean and "redux.sync.max.u32" in lean
    assert "ld.shared.v2.b32" in lean and "bar.sync" in lean and "cp.async" in lean
    # v25: the one-token lean tiles (that gate_up and the bf16 down) put the weight bits into mma
    # with no bf16 multiply and apply each block's scale as an f32 multiply-add after its mma; the
    # only bf16 multiplies left are the activations' staging (x 2^64, one per pair word of a block),
    # where the general one-token gate_up still scales every decoded pair
    for k in (lean, down1):
        assert k.count("mul.bf16x2") == 16 and "fma.rn.f32" in k
    # the bf16 one-token down: 3 warps per expert (12 per block), 2 blocks per SM
    assert ".maxntid 384" in down1 and ".minnctapersm 2" in down1
    assert gate_up1.count("mul.bf16x2") > 100
    # the tensor-core projection: bf16 mma on 8 n tiles, the warps' partials met in shared memory
    assert ".entry" in skinny and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in skinny
    assert "bar.sync" in skinny
    assert ".entry" in gemv and "cp.async" in gemv and "shfl.sync.bfly" in gemv
    # the fused router: its row's loads, one block reduction of the norm, an approximate rsqrt
    assert ".entry" in router and "bar.sync" in router and "rsqrt.approx" in router
    # the same op as the qkv head (8 warps per block: an 8-warp norm reduction) and its norm for
    # larger steps
    assert ".maxntid 256" in qkv_head and ".maxntid 128" in router
    assert ".entry" in add_norm and "rsqrt.approx" in add_norm and "mma" not in add_norm
    # the one-token qkv head's streaming kernel: one 8-warp block per SM (all of its registers),
    # the norm once per block, then a row loop whose next row's loads are issued before this row's
    # dot (two sets of 12 chunk loads in the loop body)
    assert ".maxntid 256" in stream and ".minnctapersm 1" in stream and "rsqrt.approx" in stream
    assert stream.count("ld.global.nc.v4") >= 3 * 12
    # the one-token gate_up that takes the top-k itself: bf16 logits, so a warp argmax round is one
    # redux.sync max over exact keys (no butterfly); the winner of its slot by an indexed shuffle,
    # then the same tensor-core loop
    assert "redux.sync.max.u32" in routed and "redux.sync" not in gate_up1 and "shfl.sync.idx" in routed
    assert routed.count("shfl.sync.bfly") == gate_up1.count("shfl.sync.bfly")
    for k in (gate_up1, gate_up, down1, routed):
        assert ".target sm_90a" in k and ".entry" in k
        assert "mma.sync.aligned.m16n8k16" in k  # tensor cores
    # one-token kernels prefetch their bias by cp.async; the general gate_up does not (v12c:
    # measured slower there), and only the one-token down sums its experts behind a barrier
    assert "cp.async" in gate_up1 and "cp.async" in down1
    assert "cp.async" not in gate_up
    assert "bar.sync" in down1 and "atom." not in down1
    assert "ex2.approx" in merge and ".entry" in merge
    # the merge broadcasts each split's weight from the lane that read it: one shuffle per split
    assert merge.count("shfl.sync.idx") == 16
    # the block's warp-merge buffer (TC_HEADS x 64 f32 per warp) follows the warps per block
    # RoPE inside attention: q's and the new key's partner halves come from lane ^ 2, and the
    # kernel writes the new K/V rows into the cache (the plain kernel stores only its output)
    assert tc_rope.count("shfl.sync.bfly") > tc4.count("shfl.sync.bfly")
    assert tc_rope.count("st.global") > tc4.count("st.global")
    for tc, warps in ((tc4, 4), (tc8, 8), (tc_rope, 4)):
        assert "mma.sync.aligned.m16n8k16" in tc
        assert f"_gpu_shared_mem[{warps * 8 * 64 * 4}]" in tc

    # PDL (pdl.mojo): every decode-step kernel waits for the previous grid before its first global
    # load, copy or store, and only then lets the next grid launch (loads issued before the wait
    # measured 10 % slower at batch 1)
    def accesses(body: str) -> list[int]:
        return [i for i in map(body.find, ("ld.global", "st.global", "cp.async")) if i >= 0]

    # ... except the bf16 one-token down (v26), which waits inside its lean tile, after its routing,
    # its bias copy, its first weight batch and its scales: each valid warp once there, each
    # invalid one after the tile; its routing either read (route 0) or, when routed, the top-k of
    # the logits taken before any wait (a redux round). It stores only after waiting.
    prewait = {down1, down1_routed}
    for spec, k in ptx.items():
        body = k[k.index(".entry") :]
        wait = body.index("griddepcontrol.wait")
        assert wait < body.index("griddepcontrol.launch_dependents"), spec
        if k in prewait:
            assert body.count("griddepcontrol.wait") == 2 and min(accesses(body)) < wait, spec
            assert wait < body.index("st.global") and body.count("st.global") == 1, spec
        else:
            assert wait < min(accesses(body)), spec
    assert down1_routed.index("redux.sync.max.u32") < down1_routed.index("griddepcontrol.wait")
    assert "redux.sync" not in down1 and "redux.sync" not in down1_f32
    assert ".maxntid 256" in down1_f32  # 2 warps per expert: _tile16 on hi + lo spills at 3


def test_ptx_of_the_prefill_wgmma_loops(asm, tmp_path):
    """The p2 stage loop runs unrolled by its 4 stages where it does not spill (c5's 128-token
    kernel, c7's 64-token one at three blocks per SM) and as one body elsewhere (c9's 160-token
    kernel with its two-part tile); ptxas pipelines every one of these kernels' wgmmas."""
    specs = [
        "moe_prefill_gpu.p2_gemm_kernel[False, 128, 2, 4, 2]",
        "moe_prefill_gpu.p2_gemm_kernel[False, 160, 2, 4, 2]",
        "moe_prefill_gpu.p2_gemm_kernel[True, 64, 2, 4, 3]",
        "moe_prefill_gpu.p2_absorbed_kernel[False, 128, 2, 4, 2]",
    ]
    ptx = asm.build_ptx(specs, tmp_path)
    c5, c9, c7, c10b = ptx.values()
    for k in (c5, c9, c7, c10b):
        assert ".target sm_90a" in k and "cp.async.ca.shared.global" in k
    assert all(".minnctapersm 2" in k for k in (c5, c9, c10b)) and ".minnctapersm 3" in c7
    # wgmma k16 steps: 3 token-tile variants x 2 scale paths x 4 steps per stage body; c5 has 4
    # unrolled bodies + 3 for the stages past the last multiple of 4, c9 one body and its
    # two-part tile (2 scale paths x 4 steps x 2 wgmma) on top, c10's absorbed launch that alone
    assert c5.count("wgmma.mma_async") == 3 * 2 * 4 * (4 + 3)
    assert c9.count("wgmma.mma_async") == 3 * 2 * 4 + 2 * 4 * 2
    assert c10b.count("wgmma.mma_async") == 2 * 4 * 2
    # c7: unrolled as c5, its N = 16 tile with its first 4 stages peeled (wgmma_first)
    assert c7.count("m64n32k16") == c7.count("m64n64k16") == 2 * 4 * (4 + 3)
    assert c7.count("m64n16k16") == 2 * 4 * (4 + 4 + 3)
    # ptxas serializes a kernel's wgmmas (each waits for the one before) when it lacks the
    # registers to keep one in flight (C7512) or sees the accumulators touched inside the
    # pipeline (C7515): s27's v47 (c7's N = 32 / 64 tiles unrolled beside its N = 16 body, 80
    # registers) had that, with nothing to show for it in the register or spill counts.
    ptxas = asm.wheel_ptxas()
    assert ptxas, "the nvidia-cuda-nvcc-cu12 wheel (test extras) holds ptxas"
    for spec, k in ptx.items():
        info = asm.ptxas_info(k, ptxas, tmp_path)
        assert info["perf_losses"] == 0, (spec, info)
        assert info["registers"] <= 65536 // (256 * (3 if k is c7 else 2)), (spec, info)


def test_ptxas_performance_loss_notes_are_read(asm):
    err = (
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due"
        " to insufficient register resources for the function 'k_beb0'\n"
        "ptxas info    : Used 80 registers, used 1 barriers, 24 bytes cumulative stack size\n"
        "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due"
        " to non wgmma instructions defining accumulator registers of a wgmma between start and end of the"
        " pipeline stage in the function 'k_b510'\n"
    )
    assert asm.perf_losses(err) == [
        "C7512: wgmma.mma_async instructions are serialized due to insufficient register resources",
        "C7515: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator"
        " registers of a wgmma between start and end of the pipeline stage",
    ]
    assert asm.perf_losses("ptxas info    : Used 80 registers") == []


def test_opcode_counts_read_predicated_sass(asm):
    sass = """
        /*0010*/                   HMMA.16816.F32.BF16 R44, R44, R48, R52 ;
        /*0020*/               @P5 LDG.E.128 R40, desc[UR10][R74.64+-0x100] ;
        /*0030*/              @!P0 BRA `(.L_x_2) ;
        /*0040*/                   HMMA.16816.F32.BF16 R40, R40, R48, R44 ;
    """
    assert asm.opcode_counts(sass) == {"HMMA": 2, "LDG": 1, "BRA": 1}


def test_loops_count_the_body_of_each_mma_loop(asm):
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R40, desc[UR10][R74.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R44, R44, R48, R52 ;
        /*0030*/                   IMAD.SHL.U32 R72, R28, 0x10, RZ ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0050*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, R48, gdesc[UR4], R24, gsb0 ;
        /*0090*/               @P2 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
    """
    # .L_x_2 holds no mma; the first BRA to .L_x_3 is a forward branch, the second closes a wgmma loop
    (got, wg) = asm.loops(sass)
    label, counts = got
    assert label == ".L_x_1"
    assert counts == {"LDG": 1, "HMMA": 1, "IMAD": 1, "BRA": 1}
    assert wg == (".L_x_3", {"HGMMA": 1, "BRA": 1})
    assert asm.loops(sass, needs=("HMMA",)) == [got]


def test_wgmma_waits_tell_a_pipelined_loop_from_a_serialized_one(asm):
    """The k16 steps of the p2 loop as ptxas writes them: one wgmma left in flight while the next
    fragment is decoded (main's c7), or every one waited for (v47's c7, C7512)."""
    step = """
        /*0000*/                   HMUL2.BF16_V2 R35, R38, R32 ;
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x16x16.F32.BF16 R24, R32, gdesc[UR8], R24, gsb0 ;
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, {depth} ;
"""
    for depth, want in (("0x1", {1: 4}), ("0x0", {0: 4})):
        sass = ".L_x_7:\n" + step.format(depth=depth) * 4 + "        /*0040*/               @P0 BRA `(.L_x_7) ;\n"
        sass += "        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"  # the drain after the loop
        assert asm.loop_wgmma_waits(sass) == [(".L_x_7", want)]
        assert asm.wgmma_waits(sass) == {**want, 0: want.get(0, 0) + 1}


def test_controls_decode_the_scoreboards_of_nvdisasm_hex(asm):
    # Lines of `nvdisasm -hex` for the multi-token gate_up's ring loop (sm_90a, ptxas 12): the next
    # batch's weight load counts on scoreboard 5, a scale byte from shared memory on 0, and the
    # first decode of that batch (R39 is one of its registers) waits on 5. The LDG's second word
    # 0x000f6a000c5e9d00 >> 41 = 0x7b5: stall 5, write barrier 5, no read barrier, no waits.
    hex_sass = """
.L_x_96:
        /*c6a0*/                   LDG.E.NA.128.CONSTANT R40, desc[UR14][R40.64] ;                    /* 0x0000000e28287981 */
                                                                                                      /* 0x000f6a000c5e9d00 */
        /*c700*/                   LDS.U8 R104, [R104] ;                                              /* 0x0000000068687984 */
                                                                                                      /* 0x000e280000000000 */
        /*c740*/                   HMMA.16816.F32.BF16 R48, R68, R72, R48 ;                           /* 0x000000484430723c */
                                                                                                      /* 0x000fe20000041830 */
        /*ce90*/                   SHF.L.W.U32.HI R12, R39, 0x16, R39 ;                               /* 0x00000016270c7819 */
                                                                                                      /* 0x020fe40000010e27 */
        /*dab0*/              @!P1 BRA `(.L_x_96) ;                                                   /* 0xffffffe800089947 */
                                                                                                      /* 0x000fea000383ffff */
    """  # noqa: E501
    ldg, lds, hmma, shf, bra = asm.controls(hex_sass)
    assert ldg == asm.Control("LDG.E.NA.128.CONSTANT R40, desc[UR14][R40.64]", stall=5, write=5, read=None,
                              wait=frozenset())  # fmt: skip
    assert (lds.write, lds.wait) == (0, frozenset())
    assert (hmma.write, hmma.read, hmma.wait) == (None, None, frozenset())
    assert (shf.text, shf.write, shf.wait) == ("SHF.L.W.U32.HI R12, R39, 0x16, R39", None, frozenset({5}))
    assert bra.text == "@!P1 BRA `(.L_x_96)"
    ((label, body),) = asm.control_loops(hex_sass)
    assert label == ".L_x_96" and [c.text for c in body] == [c.text for c in (ldg, lds, hmma, shf, bra)]
    # one global load, on scoreboard 5, and one instruction that waits on it
    assert asm.load_scoreboards(body) == ({5: 1}, 1)
    # the load is issued, then the decode waits for it: nothing else in flight
    assert asm.load_schedule(body) == "LDG 1 · HMMA 1 · wait"


def test_load_schedule_shows_whether_loads_fly_during_the_decode(asm):
    c = asm.Control
    ldg = c("LDG.E.NA.128.CONSTANT R40, desc[UR14][R40.64]", stall=1, write=5, read=None, wait=frozenset())
    act = c("@!P1 LDG.E.128.CONSTANT R24, desc[UR14][R42.64]", stall=1, write=5, read=None, wait=frozenset())
    mma = c("HMMA.16816.F32.BF16 R48, R68, R72, R48", stall=1, write=None, read=None, wait=frozenset())
    dec = c("SHF.L.W.U32.HI R12, R39, 0x16, R39", stall=1, write=None, read=None, wait=frozenset({5}))
    lds = c("LDS.U8 R104, [R104]", stall=1, write=0, read=None, wait=frozenset())
    on_lds = c("VIMNMX.U32 R64, R104, 0x80, !PT", stall=1, write=None, read=None, wait=frozenset({0}))
    # main's scaled loop (v32): the second half issues, then waits for everything
    main = [dec, act, act, ldg, lds, on_lds, mma, mma, ldg, act, dec, mma, mma]
    assert asm.load_schedule(main) == "wait · LDG 3 · HMMA 2 · LDG 2 · wait · HMMA 2"
    # v32: the wait first in both halves (a wait on a shared-memory load is not counted)
    fixed = [dec, act, act, ldg, lds, on_lds, mma, mma, dec, ldg, act, mma, mma]
    assert asm.load_schedule(fixed) == "wait · LDG 3 · HMMA 2 · wait · LDG 2 · HMMA 2"
    assert asm.load_schedule([mma, on_lds, mma]) == "HMMA 2"
    # cp.async into shared memory is not a load into registers: neither counted nor waited on
    cp = c("LDGSTS.E.BYPASS.128 [R3], desc[UR4][R8.64]", stall=1, write=0, read=None, wait=frozenset())
    assert asm.load_scoreboards([cp, on_lds, mma]) == ({}, 0)
    assert asm.load_schedule([cp, on_lds, mma]) == "HMMA 1"
    assert asm.load_schedule([ldg, dec, dec, mma] * 3, limit=4) == "LDG 1 · wait · HMMA 1 · LDG 1 · … (9 steps)"


def test_ptx_of_the_fused_one_token_moe(asm, tmp_path):
    """v27 (moe_fused_gpu.mojo, a probe): gate_up and down of a one-token step in one grid of
    12-warp blocks, two per SM, with no spill (ptxas of the test extras' nvcc wheel); blocks take
    tickets, gate_up blocks count their tiles, down warps spin on their expert's count and then
    read h past L1; the last block resets the counters."""
    specs = ["moe_fused_gpu.moe_one_token_kernel[0]", "moe_fused_gpu.moe_one_token_kernel[4]"]
    ptx = asm.build_ptx(specs, tmp_path)
    plain, routed = ptx.values()
    ptxas = asm.wheel_ptxas()
    assert ptxas, "the nvidia-cuda-nvcc-cu12 wheel (test extras) holds ptxas"
    for spec, k in ptx.items():
        info = asm.ptxas_info(k, ptxas, tmp_path)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (spec, info)
        assert info["registers"] <= 65536 // (2 * 384), (spec, info)  # two blocks per SM
        body = k[k.index(".entry") :]
        assert ".maxntid 384" in k and ".minnctapersm 2" in k
        wait = body.index("griddepcontrol.wait")
        first = min(i for i in map(body.find, ("ld.global", "st.global", "cp.async", "atom.")) if i >= 0)
        assert wait < first, spec
        # the ticket, up to 6 tiles' counts and the finished count
        assert body.count("atom.") == 8 and "add.u32" in body[body.index("atom.") :]
        # the down warps: a volatile spin on one word (a short sleep between polls), then h by four
        # volatile 16-byte loads
        assert body.count("ld.volatile.global.v4") == 4 and "ld.volatile.global.b32" in body, spec
        assert "nanosleep.u32" in body and "trap;" in body, spec  # a spin that never ends traps
        assert "membar.gl" in body or "fence.sc.gpu" in body or "fence.acq_rel.gpu" in body
        assert body.count("mma.sync.aligned.m16n8k16") >= 16  # two lean tiles' loops (8 mma each)
    assert "redux.sync.max.u32" in routed and "redux.sync" not in plain


def test_ptx_of_the_lean_gate_up_with_more_tiles_per_block(asm, tmp_path):
    """gate_up_lean_kernel[route, tpb]: tpb 16-row tiles per block (LEAN_TPB, 1 on main; the
    sweep of scripts/gpu_const_sweep.sh tries 3 and 4: fewer, larger blocks for the block
    scheduler). Each size keeps ~24 warps per SM with no spill, and the same loop."""
    specs = ["moe_gpu.gate_up_lean_kernel[4]", "moe_gpu.gate_up_lean_kernel[4, 3]", "moe_gpu.gate_up_lean_kernel[4, 4]"]
    ptx = asm.build_ptx(specs, tmp_path)
    ptxas = asm.wheel_ptxas()
    assert ptxas, "the nvidia-cuda-nvcc-cu12 wheel (test extras) holds ptxas"
    mmas = set()
    for (spec, k), (warps, blocks) in zip(ptx.items(), [(2, 11), (6, 4), (8, 3)], strict=True):
        assert f".maxntid {warps * 32}" in k and f".minnctapersm {blocks}" in k, spec
        info = asm.ptxas_info(k, ptxas, tmp_path)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (spec, info)
        assert warps * blocks >= 22 and info["registers"] <= 65536 // (warps * blocks * 32), (spec, info)
        body = k[k.index(".entry") :]
        assert body.index("griddepcontrol.wait") < min(
            i for i in map(body.find, ("ld.global", "st.global", "cp.async")) if i >= 0
        )
        mmas.add(body.count("mma.sync.aligned.m16n8k16"))
    assert len(mmas) == 1  # one lean tile per warp whatever the block


# Stand-in pointers for launch code that is built, never run (no GPU here): a program's
# `launch_all` starts with these, then makes the compiler build every launch branch it calls, and
# each kernel they enqueue, for nvidia:90.
LAUNCH_POINTERS = """
    var h = Pointer[Float32, MutAnyOrigin](unsafe_from_address=4096)
    var c = Pointer[UInt32, MutAnyOrigin](unsafe_from_address=4096)
    var ids = Pointer[Int32, ImmutAnyOrigin](unsafe_from_address=4096)
    var ids_out = Pointer[Int32, MutAnyOrigin](unsafe_from_address=4096)
    var u8 = Pointer[UInt8, ImmutAnyOrigin](unsafe_from_address=4096)
    var f = Pointer[Float32, ImmutAnyOrigin](unsafe_from_address=4096)
    var xb = Pointer[BFloat16, ImmutAnyOrigin](unsafe_from_address=4096)
    var ob = Pointer[BFloat16, MutAnyOrigin](unsafe_from_address=4096)
    var x32 = Pointer[Float32, ImmutAnyOrigin](unsafe_from_address=4096)
    var o32 = Pointer[Float32, MutAnyOrigin](unsafe_from_address=4096)
"""

HOST_LAUNCH = """
from std.sys import argv
from max.gpu.host import DeviceContext
from gptoss_kernels.moe_gpu import as_slots, launch_down, launch_gate_up, launch_route_gate_up


def launch_all(ctx: DeviceContext) raises:
""" + LAUNCH_POINTERS + """
    launch_gate_up[DType.bfloat16](ctx, h, c, 8, xb, ids, u8, u8, f, 2, 4, 32, 5760, 2880)
    launch_gate_up[DType.float32](ctx, h, c, 8, x32, ids, u8, u8, f, 4, 4, 128, 5760, 2880)
    launch_route_gate_up[DType.bfloat16](ctx, h, c, 8, xb, xb, ids_out, h, u8, u8, f, 4, 128, 5760, 2880)
    launch_down[DType.bfloat16](ctx, ob, h, c, f, ids, f, u8, u8, f, 2, 4, 32, 2880, 2880, xb, False)
    launch_down[DType.float32](ctx, o32, h, c, f, ids, f, u8, u8, f, 4, 4, 128, 2880, 2880, xb, True)


def main() raises:
    if len(argv()) > 1000:
        launch_all(DeviceContext())
    # (tokens, top_k, experts): 20b's 32 experts and 120b's 128, top 4
    for t in [1, 2, 3, 4, 8]:
        print("slots", t, as_slots(t, 4, 32), as_slots(t, 4, 128))
"""


def test_moe_host_launch_code_builds_for_hopper(asm, tmp_path):
    """The MoE op's GPU launch code (which kernel a step of T tokens takes) is compiled by no
    CPU test: this builds it, every launcher and dtype, for nvidia:90, and reads the slot rule
    (moe_gpu.as_slots) the device benchmarks measured: two-token steps and 120b's four-token
    steps take the one-token kernels' slots; 20b's four and both models' eight do not."""
    out = asm.run_program(HOST_LAUNCH, tmp_path, "host_launch")
    rows = {int(t): (a, b) for _, t, a, b in (line.split() for line in out.splitlines() if line.startswith("slots"))}
    assert rows == {
        1: ("True", "True"),
        2: ("True", "True"),
        3: ("False", "True"),
        4: ("False", "True"),
        8: ("False", "False"),
    }


PREFILL_LAUNCH = """
from std.sys import argv
from max.gpu.host import DeviceContext
from gptoss_kernels.moe_gate_up_mxfp4 import gate_up_gpu
from gptoss_kernels.moe_prefill_gpu import N_CONFIGS, launch_prefill_down, launch_prefill_gate_up, prefill_choice


def launch_all(ctx: DeviceContext) raises:
""" + LAUNCH_POINTERS + """
    # every tile config's launches: route, GEMMs, absorbed tiles, combine
    for cfg in range(N_CONFIGS):
        launch_prefill_gate_up(ctx, cfg, h, xb, ids, u8, u8, f, u8, 4096, 4, 128, 5760, 2880)
        launch_prefill_down[DType.bfloat16](ctx, cfg, ob, h, f, ids, f, u8, u8, f, u8, 4096, 4, 128, 2880, 2880)
    gate_up_gpu[DType.bfloat16](ctx, h, c, 360, xb, ids, u8, u8, f, u8, 4096, 4, 128, 5760, 2880, 0)


def main() raises:
    if len(argv()) > 1000:
        launch_all(DeviceContext())
    # (tokens, experts) -> the auto path's choice: -1 the decode kernel, else a tile config
    for t in [1, 64, 4096]:
        print("choice", t, prefill_choice(t, 4, 32, 2880, 2880, 0), prefill_choice(t, 4, 128, 2880, 2880, 0))
"""


def test_prefill_host_launch_code_builds_for_hopper(asm, tmp_path):
    """The prefill path's launch code (every tile config of both GEMMs, and the gate_up op's GPU
    entry) is compiled by no CPU test either: this builds it for nvidia:90 (a launch whose
    arguments stop matching its kernel's parameters fails here), and reads the auto choice: the
    decode kernel at one token, a prefill config at 4096."""
    out = asm.run_program(PREFILL_LAUNCH, tmp_path, "prefill_launch")
    lines = (line.split() for line in out.splitlines() if line.startswith("choice"))
    rows = {int(t): (int(a), int(b)) for _, t, a, b in lines}
    assert rows[1] == (-1, -1)
    assert min(rows[4096]) >= 0
