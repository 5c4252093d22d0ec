"""Shared test set-up. Triton decides between compiling and interpreting when a kernel is
defined, so the interpreter is switched on here, before any test module imports a kernel."""

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from tests.process_tree import MARK, ProcessTree, kill_marked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Every process this test session starts carries this mark; whatever is left at the end is
# killed (and named), so that no engine keeps spinning after `make test`.
os.environ.setdefault(MARK, f"session-{uuid.uuid4().hex}")


@pytest.fixture
def process_tree() -> Iterator[ProcessTree]:
    """Start a test's processes through this; all of them and their descendants die with it."""
    tree = ProcessTree()
    try:
        yield tree
    finally:
        tree.kill()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = kill_marked(os.environ[MARK])
    if left:
        print(f"\nkilled {len(left)} processes the tests left running:", *left, sep="\n  ")
