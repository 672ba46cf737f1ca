"""What llama-finetune's AdamW is fed (issue 40: why its loss rises while jitgraph's falls on the
same windows). Run llama-finetune for two steps first (ctx 256, so that it pads nothing, one
window a step; a text of 641-768 tokens makes 3 windows at stride 128, -val-split 0.33 trains 2):

    llama-finetune -m MODEL -f TEXT -c 256 -b 256 -ub 256 -t 1 -epochs 1 -lr 1e-3 \\
        -val-split 0.33 -o two.gguf
    python bench/llamacpp_adamw_check.py --model MODEL --text TEXT --llamacpp-out two.gguf

This computes the gradients g1 (window 0 at the base weights) and g2 (window 1 after the first
AdamW step) with jitgraph, token_embd frozen as llama.cpp's llama_opt_init leaves it, and
compares llama.cpp's second update with candidate updates: per form, the median and max of
|llama.cpp's update - the form's| / lr and how often their signs agree."""
import argparse

import gguf
import numpy as np

import jitgraph as jg
from jitgraph.models import llama

B1, B2, EPS = 0.9, 0.999, 1e-8


def adamw2(a, b):
    """AdamW's second update / lr with gradients a then b (ggml's bias corrections at t=2)."""
    m = B1 * (1 - B1) * a + (1 - B1) * b
    v = B2 * (1 - B2) * a * a + (1 - B2) * b * b
    return (m / (1 - B1 ** 2)) / (np.sqrt(v / (1 - B2 ** 2)) + EPS)


FORMS = {"AdamW, step 2 fed g2": lambda a, b: adamw2(a, b),
         "AdamW, step 2 fed g1 + g2 (gradient not zeroed)": lambda a, b: adamw2(a, a + b),
         "sign(g2)": lambda a, b: np.sign(b)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--llamacpp-out", required=True, help="llama-finetune's -o after two steps")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    real = llama._w

    def frozen_embedding(g, name, shape, dtype):
        if name == "token_embd.weight":
            return g.param(name, shape, "f32", trainable=False)
        return real(g, name, shape, dtype)
    llama._w = frozen_embedding
    cfg, w0, tok = llama.read_llama(args.model)
    data = open(args.text, "rb").read()
    ids = np.asarray(tok.encode(data[:-1] if data.endswith(b"\n") else data, bos=True), np.int32)
    got = {}

    def hook(grads):
        got.clear()
        got.update({k: np.array(v) for k, v in grads.items()})
    prog = jg.compile(llama.llama_forward(cfg, 1, 256, labels=True), loss="loss",
                      optimizer=jg.optim.SGD(lr=0.0), params=w0, hook=hook)
    pos = np.arange(256, dtype=np.int32)

    def grad(params, s):
        for k, v in params.items():
            prog.params[k] = v
        loss = prog.step(tokens=ids[None, s:s + 256], pos=pos, labels=ids[None, s + 1:s + 257])
        return float(loss["loss"]), dict(got)
    lr = args.lr
    l1, g1 = grad({}, 0)
    w1 = {k: (w0[k] - lr * g1[k] / (np.abs(g1[k]) + EPS)).astype(np.float32) for k in g1}
    l2, g2 = grad(w1, 128)
    print(f"losses of steps 1 and 2 (llama-finetune prints the same): {l1:.5f} {l2:.5f}")
    r = gguf.GGUFReader(args.llamacpp_out)
    lc = {t.name: np.array(t.data, np.float32).reshape(w0[t.name].shape) for t in r.tensors}
    moved = not np.array_equal(lc["token_embd.weight"], w0["token_embd.weight"])
    print(f"token_embd moved: {moved}")
    for name, f in FORMS.items():
        med, mx, agree = [], [], []
        for k in g1:
            d_lc, d = (w1[k] - lc[k]) / lr, f(g1[k], g2[k])
            med.append(np.median(np.abs(d_lc - d)))
            mx.append(np.abs(d_lc - d).max())
            agree.append(np.mean(np.sign(d_lc) == np.sign(d)))
        print(f"{name:48s} median {np.median(med):.4f}  max {max(mx):.4f}  signs agree "
              f"{100 * np.mean(agree):.2f} %")


if __name__ == "__main__":
    main()
