"""Peak memory of a piece of code, from the allocation events of torch's CPU allocator."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn) -> int:
    """The most bytes of torch CPU allocations alive at once while ``fn`` runs, beyond
    those alive when it starts."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    # By address: a block freed on a thread the profiler does not follow (Gloo's, which lets
    # go of a collective's buffers once it completes) is known freed when its address is
    # handed out again; frees of blocks made before ``fn`` are left out.
    alive: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(events):
        if size > 0:
            total += size - alive.get(ptr, 0)
            alive[ptr] = size
            peak = max(peak, total)
        elif ptr in alive:
            total -= alive.pop(ptr)
    return peak
