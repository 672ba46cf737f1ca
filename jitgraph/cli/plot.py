"""`jitgraph plot LOG.jsonl [...] --out curves.png`: training and validation loss against step
(or tokens) of one or more run logs (jitgraph/formats/runlog.py: `train --log`, `finetune
--log`, bench/llama_peers.py --log-dir), one colour per run. matplotlib is the optional extra
`plot`, imported only here and in cli/memory_picture.py (`pyplot`)."""
from __future__ import annotations

import io
import os

EXTRA = "pip install -e '.[plot]'"


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend (files, no display); a ValueError naming the extra
    when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(f"{what} needs matplotlib, which is not installed: {EXTRA} (the "
                         f"optional extra `plot`)") from None
    return plt


def figure_png(fig) -> bytes:
    """The PNG bytes of a matplotlib figure (then closed)."""
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def add_plot(p):
    p.add_argument("logs", nargs="+", metavar="LOG.jsonl",
                   help="run logs written by --log (train, finetune) or bench/llama_peers.py")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")
    p.add_argument("--x", choices=("step", "tokens"), default="step",
                   help="the horizontal axis: optimizer step, or tokens trained on (language "
                        "models' logs)")
    p.add_argument("--labels", metavar="A,B,...",
                   help="one name per log, comma-separated; default: each log's file name")
    p.add_argument("--title", default=None, help="the picture's title")
    p.set_defaults(fn=plot_logs, parser=p)


def curves(records) -> dict:
    """{"train": [(step, loss, tokens)], "val": [(step, loss)]} of a run log's records; a step
    logged twice (a run resumed from an earlier checkpoint) keeps its latest record."""
    train, val = {}, {}
    for r in records:
        if r["kind"] == "step":
            train[r["step"]] = (r["step"], r["loss"], r.get("tokens"))
        elif r["kind"] == "eval" and r.get("split", "val") == "val":
            val[r["step"]] = (r["step"], r["loss"])
    return {"train": [train[k] for k in sorted(train)], "val": [val[k] for k in sorted(val)]}


def plot_logs(args) -> int:
    from ..formats.paths import check_not_inputs, check_writable, write_atomic
    from ..formats.runlog import read_log
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else \
        [os.path.splitext(os.path.basename(p))[0] for p in args.logs]
    if len(labels) != len(args.logs):
        args.parser.error(f"argument --labels: {len(labels)} names for {len(args.logs)} logs")
    check_not_inputs({"--out": args.out}, {f"log {p}": p for p in args.logs})
    check_writable(args.out, "--out")
    runs = []
    for path in args.logs:
        c = curves(read_log(path))
        if not c["train"] and not c["val"]:
            raise ValueError(f"{path}: the log has no step or eval record to plot")
        runs.append(c)
    plt = pyplot("jitgraph plot")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, c) in enumerate(zip(labels, runs)):
        colour = colours[i % len(colours)]
        x_of = _x(args, c, label)
        if c["train"]:
            pts = [(x_of[s], loss) for s, loss, _ in c["train"] if loss is not None]
            ax.plot(*zip(*pts), color=colour, alpha=0.45, linewidth=1, label=f"{label} train")
        if c["val"]:
            pts = [(x_of.get(s, s), loss) for s, loss in c["val"] if loss is not None]
            ax.plot(*zip(*pts), color=colour, marker="o", markersize=3.5, linewidth=1.8,
                    label=f"{label} val")
    ax.set_xlabel("tokens" if args.x == "tokens" else "step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(args.title or "training and validation loss", fontsize=10)
    write_atomic(args.out, figure_png(fig))
    print(f"wrote {args.out}")
    return 0


def _x(args, c, label) -> dict:
    """{step: x} for the chosen axis; tokens need every step record to carry them."""
    if args.x == "step":
        return {s: s for s, _, _ in c["train"]} | {s: s for s, _ in c["val"]}
    tokens = {s: t for s, _, t in c["train"]}
    if not tokens or any(t is None for t in tokens.values()):
        raise ValueError(f"--x tokens: the log of {label} has step records without `tokens` "
                         f"(an MNIST log counts samples); use --x step")
    per = {s: t / s for s, t in tokens.items() if s}
    rate = next(iter(per.values()), 0)
    return tokens | {s: tokens.get(s, s * rate) for s, _ in c["val"]}
