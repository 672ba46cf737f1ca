"""Every kernel the CUDA backend (runtime/cuda) generates for the MNIST FC training program
(batch 1000, AdamW), the MNIST CNN (batch 100) and a 1-layer llama training program (rms_norm,
softmax and their backs, rope, get_rows, batched GEMMs) compiles to sm_90 PTX (numba-cuda's
NVVM, no GPU needed) and assembles with ptxas from the CUDA wheel, which reports registers per
thread, spills (none expected) and stack frames. Skips when numba-cuda is not installed; run
with -s to see the table."""
import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jitgraph as jg

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                       reason="numba-cuda not installed (pip install -e '.[cuda]')"),
    pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                       reason="the CUDA simulator has no PTX compiler"),
]


def ptxas():
    """The ptxas binary of the nvidia-cuda-nvcc wheel (or on PATH), or None."""
    for site in sys.path:
        hit = glob.glob(os.path.join(site, "nvidia", "cuda_nvcc", "bin", "ptxas"))
        if hit:
            return hit[0]
    from shutil import which
    return which("ptxas")


def generated(graph, **opts):
    """The CUDA backend's kernels for `graph` (the pipeline's kernel graph and memory plan, the
    real GPU's launch configuration), without a device."""
    from jitgraph.passes.pipeline import Options, run_pipeline
    from jitgraph.runtime.cuda import generate as program
    from jitgraph.runtime.cuda.backend import KINDS
    st = run_pipeline(graph, Options(kinds=KINDS, **opts))
    gen = program.generate(st.kernels, st.memory, tpb=256, tile=16)
    gen.kinds = {}       # kernel -> (fused kind, op of its root) of the KernelGraph kernel it runs
    for ln in gen.launches:
        if ln.kg_kernel >= 0:
            k = st.kernels.kernels[ln.kg_kernel]
            gen.kinds.setdefault(ln.kernel, (k.kind, st.graph.nodes[k.anchor if k.anchor
                                                                    is not None else k.root].op))
    return gen


def signatures(gen):
    from numba import types
    from numba.np.numpy_support import from_dtype
    sigs = {}
    for ln in gen.launches:
        sigs.setdefault(ln.kernel, types.void(*[
            types.Array(from_dtype(np.dtype(a.dtype)), len(a.shape), "C") for a in ln.args]))
    return sigs


def compile_all(gen, tmp_path, ops=None):
    """{kernel: (registers, spill bytes, stack frame bytes), None each without ptxas}; fails on
    any compile error. ops: only the kernels of KernelGraph kernels rooted at these ops."""
    from numba import cuda
    ns = {}
    exec(compile(gen.source, "<jitgraph cuda kernels>", "exec"), ns)
    tool, out = ptxas(), {}
    for name, sig in signatures(gen).items():
        if ops is not None and gen.kinds.get(name, (None, None))[1] not in ops:
            continue
        ptx, _ = cuda.compile_ptx(ns[name], sig, cc=(9, 0))
        assert ".target sm_90" in ptx and ".entry" in ptx, name
        gen.ptx = {**getattr(gen, "ptx", {}), name: ptx}
        if tool is None:
            out[name] = (None, None, None)
            continue
        path = tmp_path / f"{name}.ptx"
        path.write_text(ptx)
        r = subprocess.run([tool, "-arch=sm_90", "-v", str(path), "-o", os.devnull],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"ptxas {name}:\n{r.stderr}"
        regs = [int(w) for ln in r.stderr.splitlines() if "Used" in ln and "registers" in ln
                for w, nxt in zip(ln.split(), ln.split()[1:]) if nxt.startswith("registers")]
        words = [ln.replace(",", "").split() for ln in r.stderr.splitlines() if "spill" in ln]
        spills = [int(w[i]) for w in words for i in range(len(w) - 2)
                  if w[i + 1] == "bytes" and w[i + 2] == "spill"]
        stack = [int(w[i]) for w in words for i in range(len(w) - 2)
                 if w[i + 1] == "bytes" and w[i + 2] == "stack"]
        out[name] = (max(regs), sum(spills), max(stack, default=0))
    return out


def report(title, gen, res):
    kind = {}
    for ln in gen.launches:
        kind.setdefault(ln.kernel, f"{ln.note} {'/'.join(gen.kinds.get(ln.kernel, ()))}")
    print(f"\n{title}: {len(gen.launches)} launches, {len(gen.kernels)} kernels "
          f"(ptxas: {ptxas() or 'not found'})")
    for name, (regs, spill, stack) in res.items():
        print(f"  {name}  {kind[name]:<36} registers {regs}  spill bytes {spill}  stack {stack}")


def sim_graph(name):
    sys.path.insert(0, str(Path(__file__).parent))
    import test_cuda_sim
    return getattr(test_cuda_sim, name)()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mnist_fc", "mnist_cnn", "llama_graph"])
def test_training_program_kernels_assemble_for_sm90(which, tmp_path):
    from jitgraph.models.mnist import mnist_cnn, mnist_fc
    g = mnist_fc(1000) if which == "mnist_fc" else mnist_cnn(100) if which == "mnist_cnn" \
        else sim_graph(which)
    gen = generated(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    res = compile_all(gen, tmp_path)
    report(which, gen, res)
    assert len(res) == len(gen.kernels)
    # no register spills (rope's float64 sin/cos keep a 40-byte stack frame for libdevice's
    # argument reduction: a local array, not a spill)
    spilled = {k: s for k, (_, s, _) in res.items() if s}
    assert not spilled, f"kernels spilling registers: {spilled}"


@pytest.mark.slow
def test_decode_program_kernels_assemble_for_sm90(tmp_path):
    """The decode program's kernels (jitgraph/models/generate.py, F16 KV cache: set_rows into
    the cache, kv_attention, round_f16's cvt.rn.f16) and a partial-rope llama training step
    (slice, concat and their gradients: pad) compile to sm_90 PTX and assemble without
    spills."""
    from jitgraph.models.generate import llama_decoder
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=64, dim=64, layers=1, heads=4, kv_heads=2, ff=128, ctx=64,
                      rope_dims=8)
    for title, g, opts, ops in (
            ("llama_decode1", llama_decoder(cfg, 1, 32, True), {}, None),
            ("llama_partial_rope (its shape kernels)", llama_forward(cfg, 2, 16, labels=True),
             dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3)),
             {"slice", "concat", "pad", "slice_back"})):
        gen = generated(g, **opts)
        res = compile_all(gen, tmp_path, ops)
        report(title, gen, res)
        assert len(res) == len(gen.kernels) if ops is None else \
            {gen.kinds[k][1] for k in res} >= {"slice", "concat", "pad"}
        spilled = {k: s for k, (_, s, _) in res.items() if s}
        assert not spilled, f"{title}: kernels spilling registers: {spilled}"
        if title == "llama_decode1":
            assert any("cvt.rn.f16.f32" in src for src in gen.ptx.values())


def test_an_op_without_a_lowering_names_op_and_node(monkeypatch):
    """An op the CUDA backend has no kernel for (concat, its rule removed here): generation
    stops with an error naming the op and the node (never a silent wrong program)."""
    from jitgraph import ops
    from jitgraph.ir import Graph
    from jitgraph.runtime.cuda import table
    from jitgraph.runtime.cuda.kernel import Unsupported
    monkeypatch.delitem(table.TABLE, "concat")
    g = Graph("concat")
    a = g.input("a", (4, 6))
    g.output(y=ops.concat([a, ops.exp(a)], axis=1))
    with pytest.raises(Unsupported, match=r"op concat has no CUDA lowering yet.*node %\d+"):
        generated(g)


def test_gpu_check_parses_its_arguments():
    """bench/gpu_check.py (the one-command check for a GPU machine) imports without a GPU and
    validates its arguments; it runs only where a GPU is."""
    import importlib.util as iu
    spec = iu.spec_from_file_location("gpu_check", Path(__file__).resolve().parent.parent /
                                      "bench" / "gpu_check.py")
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = mod.parse_args(["--batch", "100", "--quick", "--no-torch", "--models", "fc,cnn"])
    assert (a.batch, a.steps, a.warmup, a.no_torch, a.models) == (100, 10, 2, True,
                                                                   ["fc", "cnn"])
    assert mod.parse_args([]).models == ["fc", "cnn", "llama"]
    for bad in (["--batch", "0"], ["--models", "fc,resnet"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
