"""The budget and sequence cap an engine gets when given none: vLLM's rows on a GPU, stepscope's
own tier on a CPU.

The GPU rows are vLLM's defaults as read at 99d7eb5 (autumn 2025, `EngineArgs._set_default_args`;
`arg_utils.py` is not stored at the tutorials' pin, stepscope.viz.lessons.VLLM_PIN): 70 GiB or
more and not an A100, or anything else. No GPU is needed: torch is told which device it has.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stepscope.engine.config import EngineConfig, device_tier_defaults

GIB = 2**30


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, name: str, gib: float) -> None:
    props = SimpleNamespace(name=name, total_memory=int(gib * GIB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


@pytest.mark.parametrize(
    ("name", "gib", "server", "offline"),
    [
        ("NVIDIA H100 80GB HBM3", 79.1, (8192, 1024), (16384, 1024)),
        ("NVIDIA H200", 139.8, (8192, 1024), (16384, 1024)),
        # A 192 GB device sits in the same row at the pin (later vLLM adds a 160 GiB tier).
        ("AMD Instinct MI300X", 191.5, (8192, 1024), (16384, 1024)),
        ("NVIDIA A100-SXM4-80GB", 79.2, (2048, 256), (8192, 256)),
        ("NVIDIA L4", 22.0, (2048, 256), (8192, 256)),
        ("NVIDIA GeForce RTX 4090", 23.6, (2048, 256), (8192, 256)),
    ],
)
def test_gpu_defaults_are_vllms_rows_at_the_pin(
    monkeypatch: pytest.MonkeyPatch, name: str, gib: float, server: tuple, offline: tuple
) -> None:
    pretend_gpu(monkeypatch, name, gib)
    assert device_tier_defaults("cuda", offline=False) == server
    assert device_tier_defaults("cuda", offline=True) == offline


def test_cpu_tier_is_a_quarter_of_vllms_cpu_budget() -> None:
    # vLLM on a CPU: 4096 tokens / 256 sequences offline, 2048 / 128 for the server.
    assert device_tier_defaults("cpu", offline=True) == (4096 // 4, 256 // 2)
    assert device_tier_defaults("cpu", offline=False) == (2048 // 4, 128 // 2)


def test_a_config_without_a_budget_takes_its_device_row() -> None:
    offline = EngineConfig.create().scheduler_config
    server = EngineConfig.create(offline=False).scheduler_config
    assert (offline.max_num_batched_tokens, offline.max_num_seqs) == (1024, 128)
    assert (server.max_num_batched_tokens, server.max_num_seqs) == (512, 64)
