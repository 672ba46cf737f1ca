"""`jitgraph dump`'s pictures: --format dot|svg|png (the IR as a graph: jitgraph/printer_dot.py,
rendered by graphviz's `dot` program) and --memory-timeline (the arena over the schedule:
cli/memory_picture.py), written to --out; the text IR as before without them."""
from __future__ import annotations

import shutil
import subprocess

from ..formats.paths import write_atomic

FORMATS = ("text", "dot", "svg", "png")


def add_picture_options(p):
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text: the printed IR; dot: graphviz dot text of the graph (kernels as "
                        "clusters after fuse, buffers coloured by arena slot after memory, "
                        "identical layers drawn once); svg, png: that picture, drawn by "
                        "graphviz's `dot` program (needs --out)")
    p.add_argument("--out", metavar="FILE",
                   help="write the IR or picture to FILE (atomically); default: standard output "
                        "(text and dot only)")
    p.add_argument("--memory-timeline", action="store_true",
                   help="draw the memory plan instead: the arena over the schedule, a box per "
                        "buffer's lifetime (x: kernel step, y: offset); needs --out FILE.png and "
                        "matplotlib (pip install -e '.[plot]')")


def check_picture_options(args):
    """Usage errors and missing tools, before anything compiles."""
    from ..formats.paths import check_not_inputs, check_writable
    if args.memory_timeline:
        if args.format not in ("text", "png"):
            args.parser.error(f"argument --memory-timeline: draws a PNG; drop --format "
                              f"{args.format}")
        if not args.out:
            args.parser.error("argument --memory-timeline: needs --out FILE.png")
        from .plot import pyplot
        pyplot("--memory-timeline")
    elif args.format in ("svg", "png"):
        if not args.out:
            args.parser.error(f"argument --format {args.format}: needs --out FILE (a picture is "
                              f"not written to a terminal)")
        if shutil.which("dot") is None:
            raise ValueError(f"--format {args.format} needs graphviz's `dot` program, which is "
                             f"not on PATH (Debian/Ubuntu: apt-get install graphviz); --format "
                             f"dot writes the dot text without it")
    if args.out:
        check_not_inputs({"--out": args.out}, {"--gguf": getattr(args, "gguf", None)})
        check_writable(args.out, "--out")


def render(dot_text: str, fmt: str) -> bytes:
    """`dot_text` drawn as `fmt` (svg, png) by graphviz's `dot` program; a PNG drawn by cairo
    and written with a palette by gd (a fraction of the bytes) where dot has both plugins."""
    for device in ((f"{fmt}:cairo:gd", fmt) if fmt == "png" else (fmt,)):
        res = subprocess.run(["dot", f"-T{device}"], input=dot_text.encode(),
                             capture_output=True)
        if res.returncode == 0:
            return res.stdout
    msg = res.stderr.decode(errors="replace").strip().splitlines()
    raise ValueError(f"graphviz's dot failed (exit {res.returncode}): "
                     f"{msg[0] if msg else 'no message'}")


def emit(args, prog=None, graph=None) -> int:
    """Print or write what `dump` asked for: of the compiled program `prog` at --stage, or of
    the uncompiled `graph` (--stage graph)."""
    if args.memory_timeline:
        from .memory_picture import draw_memory_timeline
        _, kernels, memory = prog.at_stage("memory")
        draw_memory_timeline(kernels, memory, args.out)
        if not args.quiet:
            print(f"wrote {args.out}")
        return 0
    if args.format == "text":
        text = str(graph) if prog is None else prog.ir(args.stage)
    elif prog is None:
        from ..printer_dot import to_dot
        text = to_dot(graph, title=f"{graph.name}: the graph")
    else:
        text = prog.ir(args.stage, format="dot")
    if args.format in ("svg", "png"):
        write_atomic(args.out, render(text, args.format))
    elif args.out:
        write_atomic(args.out, (text + "\n").encode())
    else:
        print(text)
        return 0
    if not args.quiet:
        print(f"wrote {args.out}")
    return 0
