"""Calls into the hand-written kernels of runtime/cpu/library.py for the ops that are not
elementwise, reductions or GEMMs: each entry turns a node's attributes into the kernel's scalar
parameters (library convention: `kernel(in1, in2, ..., out, <params>)`)."""
from __future__ import annotations

from .lower import Call, Workspace, literal


def _axis(n, g):
    return [n.attr["axis"] % max(n.type.ndim, 1)]


def _slices(n, g):
    sl = n.attr["slices"]
    return [tuple(s for s, _, _ in sl), tuple(st for _, _, st in sl)]


PARAMS = {   # op -> (library function, attrs -> extra literal parameters)
    "softmax": ("softmax", _axis),
    "log_softmax": ("log_softmax", _axis),
    "softmax_back": ("softmax_back", _axis),
    "permute": ("permute", lambda n, g: [n.attr["axes"]]),
    "slice": ("slice", _slices),
    "slice_back": ("slice_back", _slices),
    "pad": ("pad", lambda n, g: [tuple(b for b, _ in n.attr["pads"]), n.attr["value"]]),
    "get_rows": ("get_rows", lambda n, g: []),
    "get_rows_back": ("get_rows_back", lambda n, g: []),
    "rms_norm": ("rms_norm", lambda n, g: [n.attr["eps"]]),
    "rms_norm_back": ("rms_norm_back", lambda n, g: [n.attr["eps"]]),
    "layer_norm": ("layer_norm", lambda n, g: [n.attr["eps"]]),
    "layer_norm_back": ("layer_norm_back", lambda n, g: [n.attr["eps"]]),
    "rope": ("rope", lambda n, g: [n.attr["theta"], n.attr["mode"] == "neox"]),
    "rope_back": ("rope_back", lambda n, g: [n.attr["theta"], n.attr["mode"] == "neox"]),
    "causal_mask": ("causal_mask", lambda n, g: [n.attr["n_past"], n.attr["value"]]),
    "cross_entropy": ("cross_entropy", lambda n, g: []),
    "cross_entropy_back": ("cross_entropy_back", lambda n, g: []),
    "conv2d": ("conv2d", lambda n, g: _conv(n)),
    "conv2d_back_input": ("conv2d_back_input", lambda n, g: _conv(n)),
    "conv2d_back_weight": ("conv2d_back_weight", lambda n, g: _conv(n)),
    "max_pool2d": ("max_pool2d", lambda n, g: _pool(n)),
    "max_pool2d_back": ("max_pool2d_back", lambda n, g: _pool(n)),
    "avg_pool2d": ("avg_pool2d", lambda n, g: _pool(n)),
    "avg_pool2d_back": ("avg_pool2d_back", lambda n, g: _pool(n)),
}


def _conv(n):
    a = n.attr
    return [*a["stride"], *a["padding"], *a["dilation"]]


def _pool(n):
    a = n.attr
    return [*a["kernel"], *a["stride"], *a["padding"]]


def _conv_shapes(graph, n):
    """(x, w, y) shapes of the forward conv2d that node n (conv2d or a backward op) belongs to."""
    ins = [graph.nodes[i].type.shape for i in n.inputs]
    if n.op == "conv2d":
        return ins[0], ins[1], n.type.shape
    if n.op == "conv2d_back_input":      # (w, g) -> x
        return n.type.shape, ins[0], ins[1]
    return ins[0], n.type.shape, ins[1]  # conv2d_back_weight: (x, g) -> w


def _library():
    try:
        from . import library
    except ImportError:
        return None
    return library


def library_call(graph, n):
    """[Call] running node n with a library kernel, or None if there is none for its op."""
    lib = _library()
    if n.op == "concat" and lib is not None and hasattr(lib, "embed"):
        return _concat(graph, n)
    if n.op not in PARAMS or lib is None or not hasattr(lib, PARAMS[n.op][0]):
        return None
    fn, params = PARAMS[n.op]
    args = [(i, graph.nodes[i].type.shape) for i in n.inputs] + [(n.id, n.type.shape)]
    if n.op.startswith("conv2d"):
        size = lib.workspace_size_conv2d(*_conv_shapes(graph, n), *_conv(n))
        args.append(Workspace(size, n.type.dtype))
    return [Call(f"lib.{fn}", args + [literal(p) for p in params(n, graph)])]


def _concat(graph, n):
    ax, off, calls = n.attr["axis"], 0, []
    for i in n.inputs:
        starts = tuple(off if a == ax else 0 for a in range(n.type.ndim))
        calls.append(Call("lib.embed", [(i, graph.nodes[i].type.shape), (n.id, n.type.shape),
                                        literal(starts)]))
        off += graph.nodes[i].type.shape[ax]
    return calls
