# Programmatic dependent launch (PDL, sm_90+) for the decode-step kernels.
#
# A kernel launched with `pdl_attributes()` may be scheduled while the kernel
# before it in the stream still runs, once every block of that one has
# executed `griddepcontrol.launch_dependents`. Every kernel launched this way
# calls `pdl_enter()` as its first statement: `griddepcontrol.wait` blocks
# until the previous grid has completed and its memory is visible, and only
# then does the block signal its own dependents. So no block reads or writes
# anything before all earlier kernels are done (the same order as plain
# stream serialization); what overlaps is the launch and the blocks'
# placement on the SMs, which otherwise wait for the previous grid's drain.
# A kernel after ours that is launched without the attribute (MAX's) is
# serialized as usual; ours after one of MAX's (which does not signal) starts
# when that one ends.
#
# GPTOSS_MAX_PDL=0 launches without the attribute (the instructions then
# return at once), for A/B timing.

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


def pdl_attributes() -> List[LaunchAttribute]:
    """Launch attributes of a kernel that starts with `pdl_enter()`."""
    var attrs = List[LaunchAttribute]()
    if getenv("GPTOSS_MAX_PDL", "1") != "0":
        attrs.append(LaunchAttribute(LaunchAttributeID.PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttributeValue(True)))
    return attrs^
