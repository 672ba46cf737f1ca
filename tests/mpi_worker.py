"""What tests/test_mpi.py runs under `mpiexec -n N python tests/mpi_worker.py CASE OUT_DIR`.

train   AdamW steps of MNIST FC on the global batches of a fixed order, each rank on its slice
        (World.shard), gradients all-reduced by the update hook; every rank saves its slices,
        its per-step local and averaged losses and its final params to OUT_DIR/rank<r>.npz
raise   rank 1 raises inside abort_on_error: the job must end with its message
hang    rank 1 never joins the collective: rank 0 must end the job at its deadline
"""
import os
import sys
import time

import numpy as np


def train(out, steps, batch, seed=0):
    import jitgraph as jg
    from jitgraph import distributed, optim
    from jitgraph.models.mnist import mnist_fc
    world = distributed.world()
    assert world is not None, "not launched as several MPI ranks"
    with world.abort_on_error():
        local = world.local_batch(batch)
        prog = world.first(lambda: jg.compile(mnist_fc(local), loss="loss",
                                              optimizer=optim.AdamW(lr=1e-3), hook=world.hook))
        rng = np.random.default_rng(seed)
        x = rng.random((steps * batch, 784), dtype=np.float32)
        y = rng.integers(0, 10, steps * batch).astype(np.int32)
        order = rng.permutation(steps * batch)
        losses, means, slices = [], [], []
        for s in range(steps):
            b = world.shard(order[s * batch:(s + 1) * batch])
            out_ = prog.step(x=x[b], y=y[b])
            losses.append(float(out_["loss"]))
            means.append(world.mean(out_["loss"]))
            slices.append(b)
        world.check_params(prog.params, prog.calls)
        np.savez(os.path.join(out, f"rank{world.rank}.npz"), losses=losses, means=means,
                 slices=np.stack(slices), threads=world.threads,
                 allreduces=world.allreduces, **dict(prog.params))


def fail(mode):
    from jitgraph import distributed
    world = distributed.world()
    with world.abort_on_error():
        if world.rank == 1:
            if mode == "raise":
                raise ValueError("rank 1 lost its data")
            time.sleep(60)                       # hangs: never joins
        world.mean(1.0, "the test's all-reduce")
    print("unreachable: the collective completed", flush=True)


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        fail(case)
