"""Layers, run in the worker processes (inside the engine-core process with the in-process
executor): the forward's ops (RMSNorm, rotary, SiLU-and-mul) and the attention backends (`cpu`,
`torch`, `triton`) with their per-step metadata. Below models and worker: both import it, it
imports neither."""
