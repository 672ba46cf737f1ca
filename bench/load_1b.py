"""Where the load + compile time of the LLaMA-3.2-1B-shaped programs goes (issues 39 and 40), one
stage at a time, in this process:

    JITGRAPH_CACHE_DIR=DIR python bench/load_1b.py generate /work/models/llama1b-q8_0.gguf
    JITGRAPH_CACHE_DIR=DIR python bench/load_1b.py training [POLICY]

generate: imports, read_llama, the Generator's compile (passes, code generation, kernel build:
per program), the weights into the program, the rest of its construction, then the warm-up
decode step and a second one. Needs the model's memory (~1.6 GB for Q8_0).
training: the 1B full finetune's program (AdamW, ctx 512, bench/plan_finetune.py's graph)
through the passes, code generation and kernel build, nothing allocated; POLICY: its
--recompute (e.g. budget:1500000000), whose plan search is the checkpoint pass's time.
An empty JITGRAPH_CACHE_DIR measures a cold kernel cache. Prints the load average.
"""
import os
import sys
import time

T0 = time.perf_counter()


def generate(path):
    from jitgraph import compiler
    from jitgraph.formats import tensors
    from jitgraph.models import generate as G
    from jitgraph.models.llama import read_llama
    spent = {"build": 0.0, "weights": 0.0}
    imports = time.perf_counter() - T0

    def timed(key, f):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return run
    compiler.build = timed("build", compiler.build)
    tensors.FileTensor.read_into = timed("weights", tensors.FileTensor.read_into)
    t = time.perf_counter()
    model = read_llama(path, keep_types=True)
    read = time.perf_counter() - t
    t = time.perf_counter()
    gen = G.Generator(model, ctx=256, warmup=False)
    built = time.perf_counter() - t
    steps = []
    for _ in range(2):
        t = time.perf_counter()
        gen.step(0)
        gen.reset()
        steps.append(time.perf_counter() - t)
    print(f"imports {imports:.2f} s, read_llama {read:.2f} s, Generator {built:.2f} s (compile "
          f"{spent['build']:.2f} s: {gen.decode.stats()['kernel_functions']} + "
          f"{gen.prefill.stats()['kernel_functions']} kernel calls' modules; weights "
          f"{spent['weights']:.2f} s; rest {built - spent['build'] - spent['weights']:.2f} s); "
          f"first decode step {steps[0]:.2f} s, second {steps[1]:.2f} s; load average "
          f"{os.getloadavg()[0]:.1f}")


def training(policy=None):
    from jitgraph import optim
    from jitgraph.models.llama import LlamaConfig, llama_forward
    from jitgraph.passes.pipeline import Options, run_pipeline
    from jitgraph.runtime.backend import get_backend
    be = get_backend("cpu")
    imports = time.perf_counter() - T0
    cfg = LlamaConfig(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ff=8192, ctx=512,
                      tied=True)
    t = time.perf_counter()
    st = run_pipeline(llama_forward(cfg, 1, 512, labels=True),
                      Options(loss="loss", optimizer=optim.AdamW(lr=1e-5), kinds=be.kinds,
                              checkpoint=policy))
    passes = time.perf_counter() - t
    t = time.perf_counter()
    gen, _ = be.generate(st.kernels, st.memory)
    codegen = time.perf_counter() - t
    t = time.perf_counter()
    _, built = be.build(gen)
    build = time.perf_counter() - t
    print(f"imports {imports:.2f} s, passes {passes:.2f} s "
          f"({', '.join(f'{k} {v:.2f}' for k, v in st.timings.items())}), code generation "
          f"{codegen:.2f} s, build {build:.2f} s ({len(gen.kernels)} modules: "
          f"{built['kernels_compiled']} compiled, {built['kernels_loaded']} loaded); load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["generate"] and len(sys.argv) == 3:
        generate(sys.argv[2])
    elif sys.argv[1:2] == ["training"] and len(sys.argv) <= 3:
        training(*sys.argv[2:])
    else:
        sys.exit(__doc__)
