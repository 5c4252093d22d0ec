"""serving.py's plumbing without a server: the outputs of a request's prompts, interleaved."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from stepscope.engine.entrypoints.serving import interleave


def test_interleave_yields_every_streams_items_with_its_key() -> None:
    async def items(*xs: str) -> AsyncIterator[str]:
        for x in xs:
            await asyncio.sleep(0)
            yield x

    async def collect() -> list[tuple[int, str]]:
        return [item async for item in interleave({0: items("a", "b"), 1: items("c")})]

    got = asyncio.run(collect())
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")]
    assert [x for k, x in got if k == 0] == ["a", "b"]


def test_interleave_raises_a_streams_error_and_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def forever() -> AsyncIterator[str]:
        try:
            yield "x"
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def broken() -> AsyncIterator[str]:
        await asyncio.sleep(0.01)
        raise RuntimeError("child failed")
        yield ""  # an async generator

    async def run() -> None:
        merged = interleave({0: forever(), 1: broken()})
        try:
            with pytest.raises(RuntimeError, match="child failed"):
                async for _ in merged:
                    pass
        finally:
            await merged.aclose()
        assert cancelled.is_set()

    asyncio.run(run())
