"""C kernels for the CPU worker (decode and prefill attention from the paged cache, RMSNorm,
rotary, the sampler's top-k / top-p), built on first use: `build.py` compiles and loads them,
`ops.py` calls them from torch."""
