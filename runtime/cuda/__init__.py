"""The CUDA target (`jg.compile(g, target="cuda")`): numba-cuda kernels over one device arena
per program (runtime/cuda/backend.py), generated from the same kernel graph and memory plan as
the CPU target's (runtime/cuda/generate.py). Needs the `cuda` extra (numba-cuda); without a GPU,
NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda is first imported) runs it on numba's simulator."""
