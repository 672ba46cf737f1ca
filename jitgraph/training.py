"""training_graph: one static graph for a whole optimizer step (forward, backward, update)."""
from __future__ import annotations


def training_graph(graph, loss: str = "loss", optimizer=None, wrt=None):
    """autodiff + optimizer. Run a step with
    `jitgraph.interp.run(tg, {**batch, **optimizer.runtime_inputs(call)}, params_and_state)`:
    the params dict (start from `tg.init_params()`: params and zeroed optimizer state) is
    updated in place. wrt: params to train (default: every trainable param)."""
    from jitgraph.passes.autodiff import grad
    from jitgraph.passes.optimizer import apply_optimizer
    if optimizer is None:
        raise ValueError("training_graph: pass an optimizer, e.g. optimizer=jitgraph.optim.AdamW()")
    g, _ = grad(graph, loss, wrt=wrt)
    return apply_optimizer(g, optimizer, loss)[0]
