"""When a CPU kernel's loop runs over numba's thread pool (prange) instead of serially.

Both bounds count scalar work. They were set when a parallel launch woke sleeping threads
(OMP_WAIT_POLICY=PASSIVE) and kept when libgomp's spinning default made launches cheaper, so the
generated kernels stay as they were (bench/README.md: "Figures behind the code", the parallel
thresholds).
"""

# generated kernels (lower.py, fused.py): elements * (1 + math calls and divisions); their loops
# vectorise, so a launch pays only for more of their cheap units: four times the library bound
PARALLEL_MIN_WORK = 1 << 19

# hand-written kernels (lib_*.py): inner-loop iterations, an exp counting ~4; their loops are
# mostly scalar, each unit several times a vectorised element's cost
PAR_MIN_WORK = 1 << 17
