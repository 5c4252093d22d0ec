"""n > 1 in the API process: one request becomes n child requests, and their outputs one.

The engine core knows only n = 1. A request with `SamplingParams(n=k)` is fanned out here into k
children with ids `{request_id}-{i}` and, when the request has a seed, seeds `seed + i`, so the
children sample differently yet reproducibly. `LLM` merges the children's final outputs into one
`RequestOutput`; the server interleaves their streams, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

import msgspec

from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import SamplingParams

T = TypeVar("T")


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (request_id, params) of each child, in choice order; n = 1 is the request itself."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{request_id}-{i}",
            msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            ),
        )
        for i in range(params.n)
    ]


def merge_outputs(
    request_id: str, children: Sequence[RequestOutput], prompt: str | None = None
) -> RequestOutput:
    """One finished request from its children's final outputs (in choice order): completion i
    is child i's, the metrics are the first child's, each child's in `children_metrics`."""
    first = children[0]
    metrics = first.metrics
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if prompt is not None else first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[replace(c.outputs[0], index=i) for i, c in enumerate(children)],
        finished=all(c.finished for c in children),
        metrics=metrics,
        num_cached_tokens=metrics.num_cached_tokens if metrics else first.num_cached_tokens,
        children_metrics=[c.metrics for c in children if c.metrics],
        prompt_logprobs=next((c.prompt_logprobs for c in children if c.prompt_logprobs), None),
    )


async def interleave(streams: Mapping[int, AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Every child's outputs as they arrive, each with its key. The first error raised by a
    child is raised here; closing this iterator cancels the children still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((key, item))
        except BaseException as e:
            await queue.put((key, e))
        finally:
            await queue.put((key, done))

    tasks = [asyncio.create_task(pump(key, stream)) for key, stream in streams.items()]
    remaining = len(tasks)
    try:
        while remaining:
            key, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield key, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
