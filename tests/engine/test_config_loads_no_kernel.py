"""Building an `EngineConfig` (as the API server, the launcher and `serve`'s validation do) builds
and loads no C kernel: the default attention backend is picked in the worker, the only process
that runs the forward. Each check runs in a fresh interpreter, where nothing was loaded before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stepscope.kernels.cpu.build import available as cpu_kernel_available

# Prints what of the C kernels the interpreter holds after running `setup`: their Python modules
# that load them, whether build.py loaded its library, and any stepscope kernel library mapped.
PROBE = """
import json, sys
{setup}
build = sys.modules.get("stepscope.kernels.cpu.build")
with open("/proc/self/maps") as f:
    mapped = sorted({{line.split()[-1] for line in f if "stepscope-cpu-" in line}})
print(json.dumps({{
    "ops_imported": "stepscope.kernels.cpu.ops" in sys.modules,
    "build_loaded": build is not None and build._kernels is not None,
    "mapped": mapped,
}}))
"""


def kernels_after(setup: str) -> dict:
    code = PROBE.format(setup=setup)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


NOTHING_LOADED = {"ops_imported": False, "build_loaded": False, "mapped": []}


@pytest.mark.parametrize(
    "config",
    [
        "EngineConfig.create()",
        "EngineConfig.create(offline=False)",
        "EngineConfig.create(attention_backend='cpu')",
    ],
)
def test_building_a_config_loads_no_kernel_library(config: str) -> None:
    setup = f"import stepscope.engine\nfrom stepscope.engine.config import EngineConfig\n{config}"
    assert kernels_after(setup) == NOTHING_LOADED


@pytest.mark.skipif(cpu_kernel_available() is not None, reason="no C compiler for the kernels")
def test_probe_sees_the_kernels_the_worker_loads() -> None:
    """The check above can fail: the worker's default backend on a CPU loads the library."""
    setup = (
        "import torch\n"
        "from stepscope.engine.layers.attention import make_attention_backend\n"
        "assert make_attention_backend(None, 16, torch.device('cpu')).name == 'cpu'"
    )
    found = kernels_after(setup)
    assert found["build_loaded"] and found["ops_imported"]
    assert len(found["mapped"]) == 1 and found["mapped"][0].endswith(".so")
