"""The kernels package stays cheap to import, since transformers may import it by its bare name;
where a C compiler exists, its CPU kernels build."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_importing_kernels_package_loads_neither_torch_nor_triton() -> None:
    # From the repository root, the folder is also importable as a bare top-level `kernels`.
    check = (
        "import sys, kernels, stepscope.kernels; "
        "assert not {'torch', 'triton'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def test_importing_transformers_from_the_root_does_not_import_our_kernels() -> None:
    # transformers probes for a package named `kernels`; from the root it finds our folder and
    # imports its (empty) __init__, which must pull in none of our kernel modules.
    check = (
        "import sys; from transformers import AutoModelForCausalLM, LlamaForCausalLM; "
        "ours = [m for m in sys.modules if m.startswith(('kernels.', 'stepscope.kernels.'))]; "
        "assert not ours, ours"
    )
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def test_where_a_c_compiler_exists_the_cpu_kernels_build() -> None:
    # The CPU kernel tests skip on machines without a compiler; this one keeps a broken kernel
    # source from hiding behind that skip (and the engine's fallback to the torch backend).
    import shutil

    from stepscope.kernels.cpu import build

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert build.available() is None
