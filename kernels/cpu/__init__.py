"""C kernels for the CPU worker (attention from the paged cache, RMSNorm, rotary), built on
first use: `build.py` compiles and loads them, `ops.py` calls them from torch."""
