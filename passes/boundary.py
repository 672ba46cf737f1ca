"""The update boundary (compile(hook=...)): a training step run as two phases with a hook between.

Phase 1 computes the gradients (forward, backward and, with accumulate=k, their running sum);
then the executor calls the hook with the gradients, which it may change in place (an MPI
all-reduce averages them); phase 2 reads them from memory and applies the update (clipping,
the optimizer, the non-finite guard's gating). The boundary is a fact of the graph, written by
passes/optimizer.py and read by every later stage:

  graph     outputs `boundary/<param>`: the value the update of `param` consumes (the gradient,
            or with accumulation the accumulated gradient); `step` does not return them
  fuse      phase 2 = the live nodes that read a boundary value (transitively), except those
            the boundary values themselves need; no kernel holds nodes of both phases (no
            update fused into a GEMM epilogue), and every phase-1 kernel comes first
            (`KernelGraph.boundary`: the number of phase-1 kernels)
  schedule  keeps every phase-1 kernel before every phase-2 one
  memory    places the boundary values of each dtype in one contiguous bucket of the arena,
            in param order, each on a cache line, live from the first one's kernel to the
            end of the step (`MemoryPlan.gradients`, `.buckets`); the padding between them is
            zeroed at the end of phase 1, so a bucket reads as one flat array
  codegen   one driver `driver(arena, persist, io, phase)`: phase 1, phase 2, or 0 for both
Without a boundary none of this exists: the same kernels, plan and driver as before.
"""
from __future__ import annotations

from jitgraph.ir import live_nodes

PREFIX = "boundary/"


def boundary_values(graph) -> dict:
    """param name -> node id of the value its update consumes (empty without a boundary)."""
    return {k[len(PREFIX):]: i for k, i in graph.outputs.items() if k.startswith(PREFIX)}


def phase_two(graph, live=None) -> frozenset:
    """The nodes of phase 2: live nodes reading a boundary value (transitively), except the
    ancestors of the boundary values. Phase-1 nodes never read phase-2 nodes."""
    roots = list(boundary_values(graph).values())
    if not roots:
        return frozenset()
    live = live_nodes(graph) if live is None else live
    need = live_nodes(graph, roots)
    users = graph.users()
    seen, todo = set(), [u for r in roots for u in users[r]]
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        todo.extend(users[u])
    return frozenset((seen & live) - need)
