"""kvrq's CPU-only acceleration: what makes MLX's CPU device fast enough to serve agents.

- `blas`: Debian's OpenBLAS preloaded into the process (re-exec), pure Python;
- `shortcuts`: the ragged step's per-step decision of which shortcuts run (KVRQ_CPU_SHORTCUTS=0:
  none, the path Metal and CUDA take);
- `numpy_exp`: SwiGLU's exp in numpy; `gemm_rows`: OpenBLAS's fast row counts;
- `split_attention`, `native_attention` (+ `native/*.c`): attention with the softmax in C or
  numpy, decoding rows in one C call a layer.

The batching loop reaches this package through one door, engine/batch/acceleration.py; without
it (deleted, or left out of a build) the engine runs on MLX's own ops. This file imports nothing:
`blas` must stay importable without MLX.
"""
