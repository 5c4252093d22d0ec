"""The CPU KV pool: zero from the start, with no pass that writes it, and its memory committed
only as blocks are used (fresh anonymous pages; engine/worker/model_runner.py)."""

from __future__ import annotations

import psutil
import torch

from stepscope.engine.config import EngineConfig
from stepscope.engine.models.loader import resolve_model
from stepscope.engine.worker.worker import Worker

POOL_BLOCKS = 4096  # tiny-llama: 2 x 8 layers of 4096 x 16 x 4 x 16 float32, 512 MiB in all


def test_kv_pool_is_zero_and_committed_only_where_written() -> None:
    config = EngineConfig.create(model="tiny-llama", num_kv_blocks=POOL_BLOCKS)
    worker = Worker(config, resolve_model("tiny-llama"), 0, 1, None)
    me = psutil.Process()
    before = me.memory_info().rss
    worker.init_kv_cache(POOL_BLOCKS)
    caches = worker.model_runner.kv_caches
    pool_bytes = sum(t.numel() * t.element_size() for kv in caches for t in kv)
    assert pool_bytes >= 256 * 2**20
    # Allocating touched nothing: far less than the pool became resident.
    assert me.memory_info().rss - before < pool_bytes // 8
    key, value = caches[0]
    # Any block reads zero (a NaN in a padded slot would poison attention).
    for block in (0, POOL_BLOCKS // 2, POOL_BLOCKS - 1):
        assert not key[block].any() and not value[block].any()
    # Writable and independent per layer.
    key[3].fill_(1.0)
    assert key[3].all() and not caches[1][0][3].any() and not value[3].any()
    assert key.is_contiguous() and key.dtype == worker.model_runner.dtype
    assert torch.equal(key[4], torch.zeros_like(key[4]))
