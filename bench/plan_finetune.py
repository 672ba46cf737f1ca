"""The memory plan of a llama full finetune (AdamW, f32), planned without allocating or running:
`python bench/plan_finetune.py [--dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192
--vocab 128256 --ctx 512] [--recompute none,sqrt] [--top 12] [--precision bf16] [--master bf16]
[--moments bf16]` (defaults: LLaMA-3.2-1B's shape, tied embedding/output, f32 throughout).

Runs the pipeline's passes (passes/pipeline.py run_pipeline) and the CPU backend's code
generation (for the kernels' scratch space, placed after the arena), so it takes seconds and
no model memory. Prints, per recomputation policy: the persistent region (weights and AdamW's
moments), the arena (activations and gradients) and its lower bound, the workspace, the output
buffers and their sum, what `finetune` needs; then the values live at the arena's peak, summed
by op and type.
"""
import argparse
import time
from collections import Counter

from jitgraph import optim
from jitgraph.models.llama import LlamaConfig, llama_forward
from jitgraph.passes.liveness import live_bytes
from jitgraph.passes.pipeline import Options, run_pipeline
from jitgraph.runtime.cpu.backend import CPU

GIB = 1 << 30


def plan(cfg, ctx, recompute, precision="f32", master="f32", moments="f32"):
    g = llama_forward(cfg, 1, ctx, labels=True, logits=False)
    opts = Options(loss="loss", optimizer=optim.AdamW(lr=1e-5, master=master, moments=moments),
                   kinds=CPU.kinds, checkpoint=None if recompute == "none" else recompute,
                   precision=precision)
    t0 = time.perf_counter()
    st = run_pipeline(g, opts)
    gen, _ = CPU.generate(CPU, st.kernels, st.memory)     # no instance: nothing configured
    return st, gen, time.perf_counter() - t0


def report(st, gen, seconds, recompute, top):
    mp, kg, g = st.memory, st.kernels, st.graph
    weights = sum(g.nodes[g.params[k]].type.nbytes for k in st.graph.params
                  if not k.startswith("opt/"))
    outs = sum(s.nbytes for s in mp.outputs.values())
    total = mp.persist_bytes + mp.arena_bytes + gen.workspace_bytes + outs
    print(f"--recompute {recompute}: weights {weights / GIB:.3f} GiB, persistent (weights + "
          f"optimizer state) {mp.persist_bytes / GIB:.3f} GiB, arena {mp.arena_bytes / GIB:.3f} "
          f"GiB (lower bound {mp.lower_bound / GIB:.3f}), workspace "
          f"{gen.workspace_bytes / GIB:.3f} GiB, outputs {outs / GIB:.3f} GiB: "
          f"{total / GIB:.3f} GiB in all; {len(kg.kernels)} kernels, GEMM sums in place "
          f"{len(mp.sums)}; planned in {seconds:.1f} s")
    prof = live_bytes(g, mp.intervals, len(kg.kernels))
    t = prof.index(max(prof))
    by = Counter()
    for nid, (s, e) in mp.intervals.items():
        if s <= t <= e:
            n = g.nodes[nid]
            by[f"{n.op} {n.type}"] += n.type.nbytes
    print(f"  live at the peak (kernel {t} of {len(kg.kernels)}):")
    for what, nbytes in by.most_common(top):
        print(f"    {nbytes / (1 << 20):9.1f} MiB  {what}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in (("dim", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("ff", 8192),
                 ("vocab", 128256), ("ctx", 512), ("top", 12)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--recompute", default="none,sqrt")
    p.add_argument("--precision", default="f32", choices=("f32", "bf16", "f16"))
    p.add_argument("--master", default="f32", choices=("f32", "bf16"))
    p.add_argument("--moments", default="f32", choices=("f32", "bf16"))
    a = p.parse_args()
    cfg = LlamaConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads,
                      kv_heads=a.kv_heads, ff=a.ff, ctx=a.ctx, tied=True)
    for r in a.recompute.split(","):
        report(*plan(cfg, a.ctx, r, a.precision, a.master, a.moments), r, a.top)


if __name__ == "__main__":
    main()
