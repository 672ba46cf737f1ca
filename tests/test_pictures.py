"""The IR as a picture (jitgraph/printer_dot.py, `dump --format`), the memory timeline and
`jitgraph plot`: the dot text parsed back against the graph, its kernels and memory plan; PNGs
checked by their header and size."""
import re
import shutil
import struct
import subprocess
import sys

import pytest

import jitgraph as jg
from jitgraph import cli, optim
from jitgraph.formats.runlog import RunLog
from jitgraph.models import MODELS
from jitgraph.models.llama import LlamaConfig, llama_forward
from jitgraph.printer_dot import to_dot

NODE = re.compile(r"^\s*n(\d+) \[label=\"([^\"]*)\".*fillcolor=\"([^\"]*)\"", re.M)
EDGE = re.compile(r"^\s*n(\d+) -> n(\d+) \[label=\"([^\"]*)\"", re.M)
CLUSTER = re.compile(r"subgraph cluster_k(\d+) ")


def _parse(dot):
    nodes = {int(m[1]): (m[2], m[3]) for m in NODE.finditer(dot)}
    edges = {(int(m[1]), int(m[2])): m[3] for m in EDGE.finditer(dot)
             if m[3] != "update"}                    # (a value -> the param it updates)
    return nodes, edges, [int(m[1]) for m in CLUSTER.finditer(dot)]


@pytest.fixture(scope="module")
def fc():
    return jg.compile(MODELS["mnist-fc"](100), loss="loss", optimizer=optim.AdamW(lr=1e-3))


def test_graph_dot_has_a_node_per_value_and_an_edge_per_operand(fc):
    g = MODELS["mnist-fc"](100)
    nodes, edges, clusters = _parse(to_dot(g))
    assert set(nodes) == {n.id for n in g.nodes} and clusters == []
    assert set(edges) == {(i, n.id) for n in g.nodes for i in n.inputs}
    for (i, _), label in edges.items():
        assert label == str(g.nodes[i].type)            # each edge shows its operand's type
    for n in g.nodes:
        if n.op not in ("input", "param"):
            assert nodes[n.id][0] == f"%{n.id} {n.op}\\n{n.type}"


def test_fused_dot_has_a_cluster_per_kernel(fc):
    g, kernels, _ = fc.at_stage("fuse")
    dot = fc.ir("fuse", format="dot")
    nodes, edges, clusters = _parse(dot)
    assert sorted(clusters) == sorted(k.id for k in kernels.kernels)
    members = {nid for k in kernels.kernels for nid in k.nodes}
    read = {i for k in kernels.kernels for i in kernels.inputs_of(k)}
    assert set(nodes) == members | read
    assert set(edges) == {(i, n) for n in nodes for i in g.nodes[n].inputs if i in nodes}
    # each cluster holds exactly its kernel's nodes
    for k in kernels.kernels:
        body = dot.split(f"subgraph cluster_k{k.id} ", 1)[1].split("}", 1)[0]
        assert {int(m) for m in re.findall(r"\bn(\d+) \[", body)} == set(k.nodes)


def test_memory_dot_fills_values_by_arena_slot(fc):
    g, _, memory = fc.at_stage("memory")
    nodes, _, _ = _parse(fc.ir("memory", format="dot"))
    fill_of_offset = {}
    for nid, (label, fill) in nodes.items():
        slot = memory.slots.get(nid)
        if slot is None or slot.region != "arena" or nid in memory.reuses:
            continue
        assert f"arena@{slot.offset} +{slot.nbytes}" in label
        fill_of_offset.setdefault(slot.offset, set()).add(fill)
    assert len(fill_of_offset) >= 2
    assert all(len(f) == 1 for f in fill_of_offset.values())      # one colour per slot
    colours = [next(iter(f)) for f in fill_of_offset.values()]
    assert len(set(colours)) == len(colours)                       # distinct slots differ


def test_identical_layers_are_drawn_once():
    cfg = LlamaConfig(vocab=64, dim=32, layers=6, heads=2, kv_heads=2, ff=None, ctx=8)
    g = llama_forward(cfg, 1, 8, labels=True, name="llama_train")
    dot = to_dot(g)
    assert "layers 1-4 (x4, identical: drawn once)" in dot
    nodes, _, _ = _parse(dot)
    names = " ".join(label for label, _ in nodes.values())
    assert "blk.1.attn_q.weight" in names and "blk.5.attn_q.weight" in names
    assert not any(f"blk.{i}." in names for i in (2, 3, 4))
    unfolded, _, _ = _parse(to_dot(g, fold=False))
    assert len(unfolded) == len(g.nodes)
    # three layers left out: a layer is what one more layer adds to the graph
    five = llama_forward(LlamaConfig(vocab=64, dim=32, layers=5, heads=2, kv_heads=2, ff=None,
                                     ctx=8), 1, 8, labels=True, name="llama_train")
    assert len(nodes) == len(g.nodes) - 3 * (len(g.nodes) - len(five.nodes))


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="graphviz's `dot` is not installed (apt-get install graphviz)")
def test_dump_svg_draws_every_node(tmp_path, fc):
    out = tmp_path / "fc.svg"
    assert cli.main(["dump", "mnist-fc", "--stage", "fuse", "--format", "svg", "--out", str(out),
                     "--quiet"]) == 0
    svg = out.read_text()
    dot = fc.ir("fuse", format="dot")
    nodes, _, clusters = _parse(dot)
    outputs = dot.count("shape=house")                  # a node per graph output too
    assert outputs == len(fc.at_stage("fuse")[0].outputs)
    assert svg.count('class="node"') == len(nodes) + outputs
    assert svg.count('class="cluster"') == len(clusters)


def test_dump_png_without_graphviz_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))            # no `dot` on it
    out = tmp_path / "x.png"
    assert cli.main(["dump", "mnist-fc", "--format", "png", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "graphviz's `dot` program" in err[0] and "--format dot" in err[0]
    assert not out.exists()


def _png_size(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _have_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


needs_mpl = pytest.mark.skipif(not _have_matplotlib(),
                               reason="matplotlib is not installed (pip install -e '.[plot]')")


@needs_mpl
def test_plot_writes_a_png(tmp_path, capsys):
    logs = []
    for name, scale in (("fused", 1.0), ("unfused", 1.1)):
        p = tmp_path / f"{name}.jsonl"
        with RunLog(p, name) as log:
            for s in range(1, 21):
                log.step(s, scale * 3 / s, tokens=32 * s)
                if s % 5 == 0:
                    log.eval(s, scale * 3.2 / s)
        logs.append(str(p))
    out = tmp_path / "curves.png"
    assert cli.main(["plot", *logs, "--out", str(out), "--x", "tokens"]) == 0
    assert _png_size(out.read_bytes()) == (800, 450)         # figsize 8 x 4.5 at 100 dpi
    assert out.stat().st_size > 10_000


@needs_mpl
def test_memory_timeline_png(tmp_path):
    out = tmp_path / "mem.png"
    assert cli.main(["dump", "mnist-fc", "--memory-timeline", "--out", str(out), "--quiet"]) == 0
    assert _png_size(out.read_bytes()) == (900, 450)


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    p = tmp_path / "a.jsonl"
    with RunLog(p, "a") as log:
        log.step(1, 1.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import fails
    assert cli.main(["plot", str(p), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0] and ".[plot]" in err[0]


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="graphviz's `dot` is not installed (apt-get install graphviz)")
def test_hostile_names_stay_labels():
    """Names with quotes, braces, backslashes, line breaks and control characters are drawn as
    text: dot parses the output, draws every node and shows the names in the labels."""
    run = 'open("owned.txt", "w")'
    for payload in (f'z"}}\n{run}\n"', f"z\r{run}\r\n#", f"z\x00\n{run}\\",
                    f"z\u2028{run}\x0c\x0b{{}}%s\\N\\G<b>"):
        g = jg.Graph(payload)
        x = g.input(payload + "_x", (2, 3))
        w = g.param(payload + "_w", (3, 3))
        g.output(**{payload + "_y": jg.tanh(x @ w)})
        dot = to_dot(g)
        res = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True)
        assert res.returncode == 0, res.stderr
        svg = res.stdout.decode()
        assert svg.count('class="node"') == len(g.nodes) + len(g.outputs)
        assert "open(&quot;owned.txt&quot;" in svg


def test_dump_llama_takes_layers_and_a_gguf(testdata, capsys):
    from jitgraph.models.llama import read_llama
    cfg = read_llama(str(testdata.stories))[0]
    assert cli.main(["dump", "llama", "--gguf", str(testdata.stories), "--layers", "7",
                     "--stage", "graph", "--format", "dot", "--batch-size", "1"]) == 0
    dot = capsys.readouterr().out
    # the model's width from its metadata; seven layers, the middle five drawn once
    assert f'label="blk.0.attn_norm.weight\\nf32[{cfg.dim}]"' in dot
    assert "layers 1-5 (x5, identical: drawn once)" in dot and "blk.6.attn_norm" in dot
    assert "blk.7." not in dot
    with pytest.raises(SystemExit) as e:                # a usage error, exit status 2
        cli.main(["dump", "mnist-fc", "--layers", "2"])
    assert e.value.code == 2
    assert "apply to `dump llama` only" in capsys.readouterr().err
