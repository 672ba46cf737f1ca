"""`jitgraph dump ... --memory-timeline --out mem.png`: the arena over the schedule, a box per
buffer from the kernel step that writes it to the last that reads it (x) at its offset and size
(y): what in-place reuse and recomputation leave of the arena."""
from __future__ import annotations

from ..printer_dot import PALETTE


def timeline_boxes(kernels, memory) -> list:
    """(first step, last step, offset, nbytes, node id) of each arena value with a lifetime
    (a value that takes its operand's buffer in place gets its own box at that offset)."""
    out = []
    for nid, (first, last) in sorted(memory.intervals.items()):
        slot = memory.slots.get(nid)
        if slot is None or slot.region != "arena":
            continue
        out.append((first, last, slot.offset, slot.nbytes, nid))
    return out


def draw_memory_timeline(kernels, memory, path) -> None:
    from ..formats.paths import write_atomic
    from .plot import figure_png, pyplot
    plt = pyplot("--memory-timeline")
    from matplotlib.patches import Rectangle
    boxes = timeline_boxes(kernels, memory)
    steps = max(len(kernels.kernels), 1)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    offsets = sorted({b[2] for b in boxes})
    colour = {off: PALETTE[i % len(PALETTE)] for i, off in enumerate(offsets)}
    scale, unit = _unit(memory.arena_bytes)
    for first, last, off, nbytes, _ in boxes:
        ax.add_patch(Rectangle((first, off / scale), last - first + 1, nbytes / scale,
                               facecolor=colour[off], edgecolor="#333333", linewidth=0.4))
    ax.set_xlim(0, steps)
    ax.set_ylim(0, max(memory.arena_bytes, 1) / scale)
    ax.set_xlabel("kernel step (the schedule)")
    ax.set_ylabel(f"arena offset ({unit})")
    name = kernels.graph.name
    ax.set_title(f"{name}: arena {memory.arena_bytes / scale:.3g} {unit} over {steps} kernels "
                 f"({len(boxes)} buffers; naive {memory.naive_bytes / scale:.3g} {unit}, lower "
                 f"bound {memory.lower_bound / scale:.3g} {unit})", fontsize=9)
    write_atomic(path, figure_png(fig))


def _unit(n):
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return size, unit
    return 1, "B"
