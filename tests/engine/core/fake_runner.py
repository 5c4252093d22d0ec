"""The worker's side of a step, faked for the core's tests: no model, no tensors."""

from __future__ import annotations

from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    """Sample `token` for each request whose scheduled chunk reached its last known token;
    a request part way through its prefill gets an empty list, as from the real runner."""
    sampled = []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens == request.num_tokens
        sampled.append([token] if done else [])
    return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)
