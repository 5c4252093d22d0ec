"""Front-end test fixtures."""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.engine.models.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="package")
def tok() -> Any:
    """tiny-llama's tokenizer (SmolLM2's vocabulary), loaded once for the front end's tests."""
    return load_tokenizer(resolve_model("tiny-llama"))
