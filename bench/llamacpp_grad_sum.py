"""jitgraph's `finetune --epochs` made to do what llama-finetune does (issue 40): token_embd
frozen (llama.cpp's opt_init leaves it out) and, with --sum, AdamW fed the running sum of every
gradient so far (llama-finetune does not zero its gradients between steps:
bench/llamacpp_adamw_check.py). If the sum is why llama-finetune's loss rises, this run's loss
rises the same way and without --sum it falls. Any finetune options after `--`, e.g.

    python bench/llamacpp_grad_sum.py --sum -- tests/data/stories260K.gguf --text T.txt \\
        --full --ctx 256 --batch-size 1 --epochs 1 --no-ppl --out /tmp/o.gguf
"""
import sys

import numpy as np

import jitgraph
from jitgraph.cli import main
from jitgraph.models import llama


def frozen_embedding(real):
    def w(g, name, shape, dtype):
        if name == "token_embd.weight":
            return g.param(name, shape, "f32", trainable=False)
        return real(g, name, shape, dtype)
    return w


def summing(real_compile):
    """jitgraph.compile with an update hook that replaces each gradient by the sum of it and
    every earlier one."""
    total = {}

    def hook(grads):
        for k, g in grads.items():
            if k not in total:
                total[k] = np.zeros_like(g)
            total[k] += g
            g[...] = total[k]

    def compile_(graph, **kw):
        if kw.get("optimizer") is not None:
            kw["hook"] = hook
        return real_compile(graph, **kw)
    return compile_


if __name__ == "__main__":
    argv = sys.argv[1:]
    use_sum = "--sum" in argv[:argv.index("--")] if "--" in argv else "--sum" in argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    llama._w = frozen_embedding(llama._w)
    if use_sum:
        jitgraph.compile = summing(jitgraph.compile)
    sys.exit(main(["finetune", *rest]))
