"""n > 1 in the API process: one request becomes n child requests, and their outputs one.

The engine core knows only n = 1. `ParentRequest` (vLLM's, in vllm/v1/engine/parallel_sampling.py)
fans a validated request with `SamplingParams(n=k)` out into k children with ids
`{request_id}-{i}` and, when the request has a seed, seeds `seed + i`, so the children sample
differently yet reproducibly; n = 1 is its own only child. `merge` turns outputs of the children
back into outputs of the request, each completion at its choice index. `AsyncLLM` merges each
batch of streamed increments, `LLM` the children's final outputs: one mechanism for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import msgspec

from stepscope.engine.messages import EngineCoreRequest
from stepscope.engine.outputs import RequestOutput


class ParentRequest:
    """A request for n completions, as the n = 1 requests the engine core runs."""

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request_id = request.request_id
        params = request.sampling_params
        if params.n == 1:
            self.children = [request]
        else:
            self.children = [
                msgspec.structs.replace(
                    request,
                    request_id=f"{request.request_id}-{i}",
                    sampling_params=msgspec.structs.replace(
                        params, n=1, seed=None if params.seed is None else params.seed + i
                    ),
                )
                for i in range(params.n)
            ]
        self._index = {child.request_id: i for i, child in enumerate(self.children)}
        self._unfinished = set(self._index)

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    def merge(self, outputs: Sequence[RequestOutput]) -> RequestOutput:
        """The request's output from outputs of its children (at most one each): completion k is
        the one of child `outputs[k].index`, in index order, with that child's metrics at
        `children_metrics[k]` (`metrics` is the first one's). It is `finished` once every child
        has finished."""
        ordered = sorted(outputs, key=lambda out: self._index[out.request_id])
        self._unfinished.difference_update(out.request_id for out in ordered if out.finished)
        first = ordered[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[replace(out.outputs[0], index=self._index[out.request_id]) for out in ordered],
            finished=not self._unfinished,
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
            children_metrics=[out.metrics for out in ordered if out.metrics is not None],
            prompt_logprobs=next((o.prompt_logprobs for o in ordered if o.prompt_logprobs), None),
        )
