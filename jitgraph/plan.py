"""The plan: what the planning passes produce and every backend consumes.

passes/fuse.py groups the live nodes into a KernelGraph of Kernels, passes/schedule.py orders
that KernelGraph's kernels (the schedule is its kernel order), passes/memory.py places every
value in a MemoryPlan of Slots; runtime/ lowers and runs them. Both sides import this module
and neither imports the other: passes -> plan <- runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jitgraph.ir import op_kind
from jitgraph.registry import cost


# ---- kernels (passes/fuse.py, ordered by passes/schedule.py) ----------------------------------
ACCUMULATE = "gemm_accumulate"   # the backend kind of gemm kernels with Kernel.accumulate


@dataclass(frozen=True)
class Kernel:
    """A group of nodes lowered to one kernel; `nodes` in execution order, the last is the root.
    `outputs`: members whose values are read outside the kernel (each gets a buffer)."""
    id: int
    nodes: tuple
    kind: str = "node"
    outputs: tuple = ()
    anchor: int | None = None
    accumulate: tuple = ()  # gemm: ((matmul, add), ...): each product added into the output

    @property
    def root(self) -> int:
        return self.nodes[-1]

    @property
    def product(self) -> int | None:
        """gemm: the value its GEMMs leave in the output (the anchor's product, or the last
        sum accumulated into it), which the epilogue reads."""
        return self.accumulate[-1][1] if self.accumulate else self.anchor

    @property
    def needs(self) -> frozenset:
        """The backend kinds lowering this kernel takes (runtime/backend.py `kinds`)."""
        return frozenset((self.kind, ACCUMULATE) if self.accumulate else (self.kind,))


@dataclass
class KernelGraph:
    graph: object          # the jitgraph.ir.Graph the kernels read
    kernels: list          # Kernel, in execution order
    live: frozenset        # node ids whose values are needed (outputs, updates and their inputs)
    inlined: frozenset = frozenset()   # `full` nodes with no kernel and no buffer
    boundary: int | None = None   # update boundary: kernels[:boundary] are phase 1, the rest 2

    def outputs_of(self, kernel) -> tuple:
        """The values `kernel` writes to memory (the others live in registers)."""
        return kernel.outputs

    def inputs_of(self, kernel) -> tuple:
        """Node ids `kernel` reads from memory (inlined constants excluded), in first-use order."""
        mem = set(kernel.nodes)
        out = []
        for nid in kernel.nodes:
            for i in self.graph.nodes[nid].inputs:
                if i not in mem and i not in self.inlined and i not in out:
                    out.append(i)
        return tuple(out)

    def bytes_of(self, kernel) -> int:
        """Bytes `kernel` reads and writes across its boundary (inputs + outputs); a kernel of
        one node moves what its op's cost says (jitgraph/registry.py)."""
        nodes = self.graph.nodes
        if kernel.kind == "node":
            return cost(self.graph, nodes[kernel.root]).bytes
        return sum(nodes[i].type.nbytes for i in self.inputs_of(kernel) + self.outputs_of(kernel))

    def flops_of(self, kernel) -> int:
        """Arithmetic operations of `kernel`: its nodes' costs (jitgraph/registry.py) summed."""
        return sum(cost(self.graph, self.graph.nodes[i]).flops for i in kernel.nodes)

    def bytes_moved(self) -> int:
        """Bytes every kernel reads and writes across its boundary (`bytes_of`), summed."""
        return sum(self.bytes_of(k) for k in self.kernels)

    def __str__(self) -> str:
        g = self.graph
        lines = [f"kernels {g.name} ({len(self.kernels)}):"]
        for k in self.kernels:
            members = ", ".join(f"%{i} {g.nodes[i].op}" for i in k.nodes)
            outs = ", ".join(g.label(i) for i in k.outputs)
            kind = "" if k.kind == "node" else f" [{k.kind}] -> {outs}"
            if k.accumulate:
                kind += " (accumulate " + ", ".join(f"%{m}" for m, _ in k.accumulate) + ")"
            lines.append(f"  k{k.id}: {members} : {g.nodes[k.root].type}{kind}")
        if self.boundary is not None:
            lines.insert(self.boundary + 1, f"  -- update boundary: phase 1 above ({self.boundary} "
                                            f"kernels), the hook, phase 2 below --")
        if self.inlined:
            lines.append("  inlined constants: " + ", ".join(f"%{i}" for i in sorted(self.inlined)))
        return "\n".join(lines)


def rows_flags(shape, operand) -> tuple | None:
    """How `operand` (a shape) broadcasts over a row kernel's [rows, last axis] domain `shape`:
    (varies with the row, varies along the last axis), or None when it varies with only some
    of the leading axes (not expressible as one row index)."""
    lead = len(shape) - len(operand)
    full = [ax >= lead and operand[ax - lead] == d for ax, d in enumerate(shape)]
    rows = [f for ax, f in enumerate(full[:-1]) if shape[ax] != 1]
    if any(rows) and not all(rows):
        return None
    return bool(rows) and all(rows), full[-1] and shape[-1] != 1


# ---- memory (passes/memory.py) -----------------------------------------------------------------
ALIGN = 64   # bytes; every slot starts on a cache line


CALLER = ("input", "output")   # regions addressed through the driver's per-call pointer table


@dataclass(frozen=True)
class Slot:
    """Where a value lives: `region` "arena" (per-step values) or "persist" (params and
    optimizer state) at `offset`; or "input" (a program input, where the caller's array lies)
    or "output" (a graph output, the program's buffer or the caller's array) at `offset` from
    the address in entry `pointer` of the driver's per-call pointer table."""
    region: str
    offset: int
    nbytes: int
    pointer: int = 0


@dataclass
class MemoryPlan:
    slots: dict                 # node id -> Slot (a view: its range of its operand's slot)
    arena_bytes: int
    persist_bytes: int
    params: dict                # param name -> Slot in the persistent region
    copies: list = field(default_factory=list)    # (param name, node id) copied after the step
    inplace: dict = field(default_factory=dict)   # param name -> node id written into its slot
    reuses: dict = field(default_factory=dict)    # node id -> operand whose buffer it takes
    intervals: dict = field(default_factory=dict)  # arena value -> (first, last) kernel step
    naive_bytes: int = 0        # one aligned buffer per arena value
    lower_bound: int = 0        # largest live set of the arena values (bytes)
    inputs: dict = field(default_factory=dict)    # input name -> Slot in region "input"
    outputs: dict = field(default_factory=dict)   # output name -> Slot in region "output"
    gradients: dict = field(default_factory=dict)  # update boundary: param -> Slot in a bucket
    buckets: list = field(default_factory=list)   # (dtype, offset, nbytes): flat arena ranges
    pads: list = field(default_factory=list)      # (offset, nbytes) zeroed at the boundary
    sums: dict = field(default_factory=dict)      # gemm kernel's accumulate-role member -> the
                                                  # dying operand its GEMM accumulates into

    @property
    def pointers(self) -> int:
        """Entries of the driver's per-call pointer table: the inputs', then the outputs'."""
        return len(self.inputs) + len(self.outputs)

    def summary(self) -> dict:
        return {"naive_bytes": self.naive_bytes, "arena_bytes": self.arena_bytes,
                "lower_bound": self.lower_bound,
                "vs_naive": round(self.arena_bytes / max(self.naive_bytes, 1), 3),
                "vs_lower_bound": round(self.arena_bytes / max(self.lower_bound, 1), 3),
                "inplace_reuses": len(self.reuses), "buffers": len(self.intervals) -
                len(self.reuses), "persistent_bytes": self.persist_bytes,
                "updates_in_place": len(self.inplace), "updates_copied": len(self.copies),
                "gemm_sums_in_place": len(self.sums),
                "input_bytes": sum(s.nbytes for s in self.inputs.values()),
                "output_bytes": sum(s.nbytes for s in self.outputs.values()),
                **({"gradient_bytes": sum(s.nbytes for s in self.gradients.values()),
                    "gradient_bucket_bytes": sum(b[2] for b in self.buckets),
                    "gradient_buckets": len(self.buckets)} if self.buckets else {})}

    def describe(self, graph) -> str:
        s = self.summary()
        lines = [f"memory {graph.name}: arena {self.arena_bytes} B (naive {self.naive_bytes} B, "
                 f"lower bound {self.lower_bound} B), persistent {self.persist_bytes} B, "
                 f"{s['inplace_reuses']} in-place reuses; inputs {s['input_bytes']} B read and "
                 f"outputs {s['output_bytes']} B written where the caller's arrays lie"]
        for nid, sl in sorted(self.slots.items(), key=lambda kv: (
                kv[1].region, kv[1].pointer, kv[1].offset,
                self.intervals.get(kv[0], (-1, -1)), kv[0])):
            n = graph.nodes[nid]
            if nid in self.intervals:
                first, last = self.intervals[nid]
                live = f" live {first}..{last}"
            else:
                live = " view" if op_kind(n.op) == "view" else ""
            reuse = f" reuses {graph.label(self.reuses[nid])}" if nid in self.reuses else \
                f" GEMM accumulates into {graph.label(self.sums[nid])}" if nid in self.sums else ""
            where = f"{sl.region}#{sl.pointer}" if sl.region in CALLER else sl.region
            lines.append(f"  {graph.label(nid):>12} {where}@{sl.offset} +{sl.nbytes}"
                         f"{live}{reuse} : {n.type}")
        lines += [f"  gradient bucket {dt}: arena@{off} +{nb}: " + ", ".join(
            k for k, s in self.gradients.items() if off <= s.offset < off + nb)
            for dt, off, nb in self.buckets]
        lines += [f"  update {p} <- %{i} in place" for p, i in self.inplace.items()]
        lines += [f"  update {p} <- {graph.label(i)} copied after the step" for p, i in self.copies]
        return "\n".join(lines)
