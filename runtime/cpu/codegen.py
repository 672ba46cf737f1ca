"""CPU code generation: one C-callable entry module per kernel, one LLVM IR driver per program.

Every value lives where the memory plan put it: in one of two byte arrays — `arena` (per-step
values) and `persist` (params and optimizer state) — at its offset, or, for the plan's regions
"input" and "output", in a caller's array whose address is entry `pointer` of the int64 table
`io` the executor fills each call (inputs read where they lie, outputs written into the
caller's arrays). Each kernel is compiled as a numba `cfunc` that takes buffer addresses
(shapes are constants), and registered as the symbol `jitgraph_<name>` (runtime/cpu/cache.py). The
driver `DRIVER(arena, persist, io)` is LLVM IR text: the straight-line calls of those symbols,
in order, with base address + offset, then the copies into params (llvm.memcpy). A step is one
Python->native call; the driver never links the kernels' code into its own and needs no
optimisation, so llvmlite compiles it fast even at hundreds of calls
(runtime/cpu/backend.Driver), and each kernel is compiled (and cached) once whatever program uses
it. Each call is preceded by the IR node it implements as a `;` comment, so the source reads
as an IR dump. With an update boundary (passes/boundary.py: `kg.boundary` phase-1 kernels) the
driver is `DRIVER(arena, persist, io, phase)`: phase 1 runs the phase-1 kernels and zeroes the
plan's `pads` (the bytes between the gradients of a bucket; llvm.memset), phase 2 the rest and
the copies into params, phase 0 both.
"""
from __future__ import annotations

from dataclasses import dataclass

from jitgraph.plan import CALLER   # the memory plan's regions addressed through the io table
from jitgraph.printer import format_node
from jitgraph.types import TensorType

from ..kernelgen import NP_DTYPE, literal
from . import fused, lower
from .table import lowering

ENTRY_HEADER = '''"""jitgraph kernel (generated; the file name is a hash of this text and the toolchain)."""
import math

import numpy as np
from numba import carray, cfunc, njit, prange, types

from jitgraph.runtime.cpu import approx, halfconv
from jitgraph.runtime.cpu.pointers import ptr
'''


@dataclass
class Generated:
    kernels: dict          # module name -> source text
    driver: str            # driver module name
    driver_source: str
    n_calls: int           # kernel invocations per step
    workspace_bytes: int   # scratch space the arena needs after the memory plan's values
    calls: list            # (node id, kernel name, [(base, offset) per address], dims) in
    #                        order; base: "arena", "persist", or an int, the entry of the io
    #                        table; dims: the dimensions passed after the addresses
    phases: int = 1        # 2: the driver takes a `phase` argument (update boundary)


def lower_node(graph, n, slot_of=lambda nid: None):
    """The Calls implementing node n alone, by its op's rule (runtime/cpu/table.py); raises
    NotImplementedError when the CPU backend has no lowering for the op. Elementwise and
    last-axis row ops use the fused kernels' generator with one member, so fused and unfused
    programs differ only in grouping."""
    rule = lowering(n.op)
    calls = rule.node(graph, n, slot_of) if rule is not None else None
    if calls is None:
        raise NotImplementedError(f"op {n.op} has no CPU lowering (node %{n.id}: "
                                  f"{format_node(graph, n).strip()})")
    return calls


def lower_kernel(graph, kg, kernel, slot_of):
    """The Calls running a fused kernel of passes/fuse.py (any kind but "node"): an elementwise
    one by the fused generator, any other by the rule of the op anchoring it."""
    if kernel.kind == "elementwise":
        return [fused.elementwise(graph, kernel, kg.inlined, slot_of=slot_of)]
    return lowering(graph.nodes[kernel.anchor].op).kernel(graph, kg, kernel, slot_of)


def entry_module(graph, call, name_of):
    """(name, text, n_parameters, dims) of the cfunc module running `call`: a generated kernel's
    body goes inline on constant-shape buffers; a BLAS/library kernel is called on buffers whose
    dimensions are parameters too (`dims`, the values the driver passes after the addresses),
    so one module serves every shape of a call (a model's layers and its programs' sequence
    lengths share the compiled kernel)."""
    params, cargs, dims = [], [], []
    shaped = call.source is not None        # generated loops keep constant shapes
    for a in call.args:
        if isinstance(a, str):
            cargs.append(a)
            continue
        params.append(f"p{len(params)}")
        if isinstance(a, lower.Workspace):
            shape, dt = a.shape or (a.size,), a.dtype
        else:
            shape, dt = a[1], graph.nodes[a[0]].type.dtype
            t = graph.nodes[a[0]].type
            if t.is_block:              # a weight in a block type: its rows' bytes
                shape, dt = (t.size // t.shape[-1], t.row_bytes), "u8"
        if shaped:
            spelled = literal(tuple(shape))
        else:
            names = [f"n{len(dims) + i}" for i in range(len(shape))]
            dims += [int(d) for d in shape]
            spelled = f"({', '.join(names)}{',' if len(names) == 1 else ''})"
        cargs.append(f"carray(ptr({params[-1]}), {spelled}, {NP_DTYPE[dt]})")
    text = ENTRY_HEADER + "".join(ln + "\n" for ln in call.imports)
    fm = f", fastmath={lower.FASTMATH}" if call.fastmath else ""
    if call.source is None:
        if call.func.startswith("gemm_"):
            text += f"from jitgraph.runtime.cpu.blas import {call.func}\n"
        elif call.func.startswith("lib."):
            text += "from jitgraph.runtime.cpu import library as lib\n"
        body = [f"{call.func}({', '.join(cargs)})"]
    elif call.parallel:
        # prange directly inside a cfunc ran only part of 1-D loops (numba 0.68): parallel
        # bodies are @njit functions the cfunc calls
        names, lines = call.source
        text += f'\n\n@njit(error_model="numpy", nogil=True, parallel=True{fm})\n' + \
            f"def body({', '.join(names)}):\n" + "".join(f"    {ln}\n" for ln in lines)
        body = [f"body({', '.join(cargs)})"]
    else:
        names, lines = call.source
        body = [f"{n} = {c}" for n, c in zip(names, cargs)] + list(lines)
    params += [f"n{i}" for i in range(len(dims))]
    sig = ", ".join(["types.intp"] * len(params))
    text += f'\n\n@cfunc(types.void({sig}), cache=True, error_model="numpy"{fm})\n' + \
        f"def KERNEL({', '.join(params)}):\n" + "".join(f"    {ln}\n" for ln in body)
    name = name_of("k", text)
    return name, text.replace("KERNEL", name), len(params), tuple(dims)


def generate(kg, plan, name_of) -> Generated:
    """Kernel modules and driver source (LLVM IR) for a KernelGraph and its MemoryPlan."""
    g = kg.graph
    kernels, calls, work = {}, [], 0
    work_at = lower.aligned(plan.arena_bytes)
    drv = _Driver()

    def address(a):
        nonlocal work
        if isinstance(a, lower.Workspace):
            work = max(work, a.offset + a.size * TensorType(a.dtype, ()).np_dtype.itemsize)
            return "arena", work_at + a.offset
        return _base(plan.slots[a[0]])

    def slot_of(nid):
        # one name per buffer: each entry of the io table is a region of its own
        s = plan.slots.get(nid)
        return None if s is None else \
            (s.region + (str(s.pointer) if s.region in CALLER else ""), s.offset, s.nbytes)

    split = kg.boundary is not None
    for k in kg.kernels:
        if split and k.id == kg.boundary:
            drv.phase_end(plan)
        if k.kind != "node":
            drv.comment(f"k{k.id} [{k.kind}]")
        for nid in k.nodes:
            drv.comment(format_node(g, g.nodes[nid]).strip())
        todo = lower_node(g, g.nodes[k.root], slot_of) if k.kind == "node" else \
            lower_kernel(g, kg, k, slot_of)
        for c in todo:
            name, text, nargs, dims = entry_module(g, c, name_of)
            kernels[name] = (text, nargs)
            addrs = [address(a) for a in c.args if not isinstance(a, str)]
            calls.append((k.root, name, addrs, dims))
            drv.call(name, addrs, dims)
    if split and kg.boundary == len(kg.kernels):
        drv.phase_end(plan)
    for name, nid in plan.copies:
        src, dst = plan.slots[nid], plan.params[name]
        drv.comment(f"update {name} <- {g.label(nid)} (copy)")
        drv.copy(("persist", dst.offset), _base(src), dst.nbytes)
    for name, nid in plan.inplace.items():
        drv.comment(f"update {name} <- %{nid} (written in place)")
    head = [comment(f"jitgraph driver for graph {g.name} (generated)", ";"),
            comment("DRIVER(arena, persist, io" + (", phase" if split else "") +
                    "): one step, the kernels called in order at base address + offset", ";"),
            comment("(LLVM IR, compiled by llvmlite: runtime/cpu/backend.Driver)", ";")]
    head += [comment(f"io[{s.pointer}]: {s.region} {k}", ";") for k, s in
             [*plan.inputs.items(), *plan.outputs.items()]]
    decls = sorted((k, n) for k, (_, n) in kernels.items())
    text = "\n".join(head + [""] + drv.module(decls, split, plan.pointers))
    driver = name_of("d", text)
    work_bytes = work_at + work - plan.arena_bytes if work else 0
    return Generated({k: t for k, (t, _) in kernels.items()}, driver,
                     text.replace("DRIVER", driver), len(calls), work_bytes, calls,
                     2 if split else 1)


BOUNDARY = "; -- update boundary --"


class _Driver:
    """The driver as LLVM IR text: straight-line calls of the kernels' C entry points
    (`void jitgraph_<name>(i64 address, ...)`, the symbols runtime/cpu/cache.py registers), then
    the update copies (llvm.memcpy, or llvm.memmove within one region), and at the update
    boundary the zeroing of the bucket pads (llvm.memset). Every address is an i64: the arena
    `%a`, the persistent region `%p`, or entry n of the io table, `%io<n>` (loaded once per
    call), plus an offset. User strings appear only in `;` comments (codegen.comment)."""

    def __init__(self):
        self.lines, self.n, self.io = [], 0, set()

    def comment(self, text):
        self.lines.append("  " + comment(text, ";"))

    def value(self, base, offset):
        if isinstance(base, int):
            self.io.add(base)
            v = f"%io{base}"
        else:
            v = "%a" if base == "arena" else "%p"
        if not offset:
            return v
        self.n += 1
        self.lines.append(f"  %v{self.n} = add i64 {v}, {offset}")
        return f"%v{self.n}"

    def pointer(self, base, offset):
        v = self.value(base, offset)
        self.n += 1
        self.lines.append(f"  %v{self.n} = inttoptr i64 {v} to ptr")
        return f"%v{self.n}"

    def call(self, name, addrs, dims=()):
        args = ", ".join([f"i64 {self.value(*a)}" for a in addrs] + [f"i64 {d}" for d in dims])
        self.lines.append(f"  call void @jitgraph_{name}({args})")

    def copy(self, dst, src, nbytes):
        d, s = self.pointer(*dst), self.pointer(*src)
        op = "memmove" if dst[0] == src[0] else "memcpy"     # one region: they could overlap
        self.lines.append(f"  call void @llvm.{op}.p0.p0.i64(ptr {d}, ptr {s}, i64 {nbytes}, "
                          f"i1 false)")

    def phase_end(self, plan):
        """The end of phase 1: the padding between a bucket's gradients zeroed, then the marker."""
        self.comment("zero the padding between the gradients of the buckets")
        for off, n in plan.pads:
            p = self.pointer("arena", off)
            self.lines.append(f"  call void @llvm.memset.p0.i64(ptr {p}, i8 0, i64 {n}, i1 false)")
        self.lines.append(BOUNDARY)

    def module(self, kernels, split, pointers):
        """The module's lines: declarations, then DRIVER; with `split`, phase 1 (or 0) runs the
        lines above the boundary marker, phase 2 (or 0) those below."""
        out = [f"declare void @jitgraph_{k}({', '.join(['i64'] * n)})" for k, n in kernels]
        out += ["declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)",
                "declare void @llvm.memmove.p0.p0.i64(ptr, ptr, i64, i1)",
                "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)", "",
                f"define void @DRIVER(i64 %a, i64 %p, i64 %io{', i32 %phase' if split else ''})"
                " {", "entry:"]
        if self.io:
            out.append("  %iot = inttoptr i64 %io to ptr")
        for i in sorted(self.io):
            if not 0 <= i < pointers:
                raise AssertionError(f"driver: io entry {i} outside the table of {pointers}")
            out += [f"  %iop{i} = getelementptr i64, ptr %iot, i64 {i}",
                    f"  %io{i} = load i64, ptr %iop{i}"]
        body = self.lines
        if split:
            at = body.index(BOUNDARY)
            out += ["  %one = icmp ne i32 %phase, 2", "  br i1 %one, label %phase1, label %test2",
                    "phase1:", *body[:at], "  br label %test2",
                    "test2:", "  %two = icmp ne i32 %phase, 1",
                    "  br i1 %two, label %phase2, label %done",
                    "phase2:", *body[at + 1:], "  br label %done", "done:"]
        else:
            out += body
        return out + ["  ret void", "}", ""] + THUNK.format(
            phase=", i32 %phase" if split else "").splitlines() + [""]


# What the Python side calls (runtime/cpu/backend.Driver): the addresses of the arena, the
# persistent region and the io table, stored once into DRIVER.ctx, and the phase (0 unphased).
THUNK = """@DRIVER.ctx = global [3 x i64] zeroinitializer

define void @DRIVER.run(i32 %phase) {{
entry:
  %a = load i64, ptr @DRIVER.ctx
  %pp = getelementptr [3 x i64], ptr @DRIVER.ctx, i64 0, i64 1
  %p = load i64, ptr %pp
  %iop = getelementptr [3 x i64], ptr @DRIVER.ctx, i64 0, i64 2
  %io = load i64, ptr %iop
  call void @DRIVER(i64 %a, i64 %p, i64 %io{phase})
  ret void
}}"""


def comment(text: str, mark: str = "#") -> str:
    """A source comment (`mark`: "#" Python, ";" LLVM IR) showing `text`, which may hold user
    strings (graph, input, param and output names): every character that could end the comment
    line or the source (newlines, other control and non-printable characters) is written as its
    escape, so user strings reach generated code only as comment text, never as code."""
    return mark + " " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _base(slot):
    """(base, offset) of a plan Slot: base "arena", "persist", or the io table entry (an int)."""
    return (slot.pointer if slot.region in CALLER else slot.region), slot.offset
