"""The kernels package stays cheap to import, since transformers may import it by its bare name."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_kernels_package_loads_neither_torch_nor_triton() -> None:
    # From the repository root, the folder is also importable as a bare top-level `kernels`.
    check = (
        "import sys, kernels, stepscope.kernels; "
        "assert not {'torch', 'triton'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)
