"""CPU code generation: one C-callable entry module per kernel, one @njit driver per program.

Every value lives where the memory plan put it: in one of two byte arrays — `arena` (per-step
values) and `persist` (params and optimizer state) — at its offset, or, for the plan's regions
"input" and "output", in a caller's array whose address is entry `pointer` of the int64 table
`io` the executor fills each call (inputs read where they lie, outputs written into the
caller's arrays). The driver is `DRIVER(arena, persist, io)`. Each kernel is compiled as a
numba `cfunc` that takes buffer addresses (shapes are constants), and the driver calls the
kernels by symbol, in order, with base address + offset: a step is one Python->native call, and
the driver never links the kernels' code into its own, so it compiles in a fraction of a second
and each kernel is compiled (and cached) once whatever program uses it.
Each call is preceded by the IR node it implements, so the source reads as an IR dump.
With an update boundary (passes/boundary.py: `kg.boundary` phase-1 kernels) the driver is
`DRIVER(arena, persist, io, phase)`: phase 1 runs the phase-1 kernels and zeroes the plan's
`pads` (the bytes between the gradients of a bucket), phase 2 the rest and the copies into
params, phase 0 both.
"""
from __future__ import annotations

from dataclasses import dataclass

from jitgraph.printer import format_node
from jitgraph.types import TensorType

from . import fused, lower
from .table import lowering

CALLER = ("input", "output")   # the memory plan's regions addressed through the io table

ENTRY_HEADER = '''"""jitgraph kernel (generated; the file name is a hash of this text and the toolchain)."""
import math

import numpy as np
from numba import carray, cfunc, njit, prange, types

from jitgraph.runtime.cpu import approx
from jitgraph.runtime.cpu.pointers import ptr
'''


@dataclass
class Generated:
    kernels: dict          # module name -> source text
    driver: str            # driver module name
    driver_source: str
    n_calls: int           # kernel invocations per step
    workspace_bytes: int   # scratch space the arena needs after the memory plan's values
    calls: list            # (node id, kernel name, [(base, offset) per address]) in order;
    #                        base: "arena", "persist", or an int, the entry of the io table
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
    """(name, text, n_addresses) of the cfunc module running `call` on constant-shape buffers:
    a generated kernel's body goes inline, a BLAS/library kernel is called."""
    params, cargs = [], []
    for a in call.args:
        if isinstance(a, str):
            cargs.append(a)
            continue
        params.append(f"p{len(params)}")
        if isinstance(a, lower.Workspace):
            shape, dt = a.shape or (a.size,), a.dtype
        else:
            shape, dt = a[1], graph.nodes[a[0]].type.dtype
        cargs.append(f"carray(ptr({params[-1]}), {lower.literal(tuple(shape))}, "
                     f"{lower.NP_DTYPE[dt]})")
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
    sig = ", ".join(["types.intp"] * len(params))
    text += f'\n\n@cfunc(types.void({sig}), cache=True, error_model="numpy"{fm})\n' + \
        f"def KERNEL({', '.join(params)}):\n" + "".join(f"    {ln}\n" for ln in body)
    name = name_of("k", text)
    return name, text.replace("KERNEL", name), len(params)


def generate(kg, plan, name_of) -> Generated:
    """Kernel modules and driver source for a KernelGraph and its MemoryPlan."""
    g = kg.graph
    kernels, body, calls, work = {}, [], [], 0
    work_at = -(-plan.arena_bytes // 64) * 64

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
            body += _phase_end(plan)
        if k.kind != "node":
            body.append(f"# k{k.id} [{k.kind}]")
        body += [comment(format_node(g, g.nodes[nid]).strip()) for nid in k.nodes]
        todo = lower_node(g, g.nodes[k.root], slot_of) if k.kind == "node" else \
            lower_kernel(g, kg, k, slot_of)
        for c in todo:
            name, text, nargs = entry_module(g, c, name_of)
            kernels[name] = (text, nargs)
            addrs = [address(a) for a in c.args if not isinstance(a, str)]
            calls.append((k.root, name, addrs))
            body.append(f"{name}({', '.join(_address(*a) for a in addrs)})")
    if split and kg.boundary == len(kg.kernels):
        body += _phase_end(plan)
    for name, nid in plan.copies:
        src, dst = plan.slots[nid], plan.params[name]
        body.append(comment(f"update {name} <- {g.label(nid)} (copy)"))
        if src.region in CALLER:
            body.append(f"copy_bytes({_address('persist', dst.offset)}, "
                        f"{_address(*_base(src))}, {dst.nbytes})")
        else:
            body.append(f"persist[{dst.offset}:{dst.offset + dst.nbytes}] = "
                        f"{src.region}[{src.offset}:{src.offset + src.nbytes}]")
    for name, nid in plan.inplace.items():
        body.append(comment(f"update {name} <- %{nid} (written in place)"))
    head = [comment(f"jitgraph driver for graph {g.name} (generated)"), "import numpy as np",
            "from numba import njit", "", "from jitgraph.runtime.cache import entry",
            "from jitgraph.runtime.cpu.pointers import copy_bytes", ""]
    head += [comment(f"io[{s.pointer}]: {s.region} {k}") for k, s in
             [*plan.inputs.items(), *plan.outputs.items()]]
    head += [f'{k} = entry(__file__, "{k}", {nargs})' for k, (_, nargs) in sorted(kernels.items())]
    if split:
        body = _phased(body)
    body = ["a = np.int64(arena.ctypes.data)", "p = np.int64(persist.ctypes.data)"] + body
    text = "\n".join(head) + "\n\n\n" + '@njit(cache=True, error_model="numpy", nogil=True)\n' + \
        f"def DRIVER(arena, persist, io{', phase' if split else ''}):\n" + \
        "\n".join("    " + ln for ln in body) + "\n"
    driver = name_of("d", text)
    work_bytes = work_at + work - plan.arena_bytes if work else 0
    return Generated({k: t for k, (t, _) in kernels.items()}, driver,
                     text.replace("DRIVER", driver), len(calls), work_bytes, calls,
                     2 if split else 1)


BOUNDARY = "# -- update boundary --"


def _phase_end(plan):
    """The end of phase 1: the padding between a bucket's gradients zeroed, then the marker."""
    return [comment("zero the padding between the gradients of the buckets")] + \
        [f"arena[{off}:{off + n}] = 0" for off, n in plan.pads] + [BOUNDARY]


def _phased(body):
    """The driver body split at the boundary marker: phase 1 (or 0) runs the lines above it,
    phase 2 (or 0) those below."""
    at = body.index(BOUNDARY)
    one, two = body[:at], body[at + 1:]
    return ["if phase != 2:", *["    " + ln for ln in one], "    pass",
            "if phase != 1:", *["    " + ln for ln in two], "    pass"]


def comment(text: str) -> str:
    """A source comment showing `text`, which may hold user strings (graph, input, param and
    output names): every character that could end the comment line or the source (newlines,
    other control and non-printable characters) is written as its escape, so user strings reach
    generated code only as comment text, never as code."""
    return "# " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _base(slot):
    """(base, offset) of a plan Slot: base "arena", "persist", or the io table entry (an int)."""
    return (slot.pointer if slot.region in CALLER else slot.region), slot.offset


def _address(base, offset):
    base = f"io[{base}]" if isinstance(base, int) else "a" if base == "arena" else "p"
    return f"{base} + {offset}" if offset else base
