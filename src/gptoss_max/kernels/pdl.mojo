# Programmatic dependent launch (PDL, sm_90+) for one-token decode steps.
#
# A kernel launched with the programmatic-serialization attribute may be
# scheduled while the kernel before it in the stream still runs, once every
# block of that one has executed `griddepcontrol.launch_dependents`. Each of
# our decode-step kernels calls `pdl_enter()` as its first statement:
# `griddepcontrol.wait` blocks until the previous grid has completed and its
# memory is visible, and only then does the block signal its own dependents.
# So no block loads or stores anything before every earlier kernel is done
# (the order of plain stream serialization); what overlaps is the launch and
# the blocks' placement on the SMs, which otherwise wait for the previous
# grid's drain. A kernel after ours launched without the attribute (MAX's)
# is serialized as usual; ours after one of MAX's (which does not signal)
# starts when that one ends. Without the attribute both instructions return
# at once.
#
# Measured (H100, bench/NOTES.md "PDL"): +0.8-0.9 % decode tok/s at batch 1
# (20b and 120b, CUDA graphs), −1.7 % at 20b batch 64; so only one-token
# steps launch with it.
#
# One kernel loads before its wait: the bf16 one-token down (moe_gpu,
# down_one_token_kernel, v26) takes its routing from grids two or more back
# and issues its first weights and scales, then waits just before it reads
# h, which gate_up writes. Its first e2e runs looked 15 % slower, but that
# was the e2e bench's two modes (decode steps of ~1.66 or ~2.14 ms at 20b
# batch 1 on the H200), not the loads: main and v26 each ran in both
# (bench/NOTES.md, "Twelfth session"). The 2026-11-23 "−10 %" against
# loads before the wait (qkv head, attention; H100) may have been the same;
# it was not re-run. Every other kernel still waits first; test_kernel_asm
# checks both.
#
# GPTOSS_MAX_PDL=0 launches without the attribute, for A/B timing.

from max.gpu.host.launch_attribute import LaunchAttribute, LaunchAttributeID, LaunchAttributeValue
from std.os import getenv
from std.sys._assembly import inlined_assembly
from std.sys.info import _is_sm_9x_or_newer


@always_inline
def pdl_enter():
    """Wait for the previous grid, then let the next one launch."""
    comptime if _is_sm_9x_or_newer():
        inlined_assembly["griddepcontrol.wait;", NoneType, constraints="~{memory}", has_side_effect=True]()
        inlined_assembly["griddepcontrol.launch_dependents;", NoneType, constraints="~{memory}", has_side_effect=True]()


def pdl_attributes(one_token: Bool) -> List[LaunchAttribute]:
    """Launch attributes of a kernel that starts with `pdl_enter()`: PDL for
    one-token steps (unless GPTOSS_MAX_PDL=0), none otherwise."""
    var attrs = List[LaunchAttribute]()
    if one_token and getenv("GPTOSS_MAX_PDL", "1") != "0":
        attrs.append(LaunchAttribute(LaunchAttributeID.PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttributeValue(True)))
    return attrs^
