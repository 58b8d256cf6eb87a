"""A step's `RequestOutput`s: the stop rules applied to each sampled request, and the requests
the scheduler dropped without running."""

from __future__ import annotations

from gpu_runtime.engine.request import RequestOutput, RequestStatus
from gpu_runtime.engine.runner_types import ModelRunnerOutput
from gpu_runtime.engine.scheduler import Scheduler
from gpu_runtime.engine.stopping import StopChecker


class StepOutputs:
    """Builds outputs from the scheduler's requests; finishes those a stop rule ends."""

    def __init__(self, scheduler: Scheduler, stop_checker: StopChecker) -> None:
        self.scheduler = scheduler
        self.stop_checker = stop_checker

    def rejected(self) -> list[RequestOutput]:
        """One failed output per request the scheduler dropped since the last call."""
        return [
            RequestOutput(
                r.request_id,
                [],
                r.output_token_ids,
                "",
                True,
                RequestStatus.FINISHED_ABORTED.value,
                len(r.prompt_token_ids),
                error=str(r.stop_reason),
            )
            for r in self.scheduler.take_rejected()
        ]

    def sampled(self, result: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        """Stop rules and one output per sampled request still live (its token already in the
        scheduler's request), appended to `outputs`."""
        scheduler = self.scheduler
        get_request, check = scheduler.get_request, self.stop_checker.check
        logprobs = result.logprobs
        for request_id, token in result.sampled.items():
            request = get_request(request_id)
            if request is None:
                continue  # finished or aborted after its step was launched
            text, status, reason = check(request)
            if status is not None:
                scheduler.finish_request(request_id, status)
                request.stop_reason = reason
            logprob = logprobs.get(request_id) if logprobs else None
            outputs.append(
                RequestOutput(
                    request_id,
                    [token],
                    request.output_token_ids,
                    text,
                    status is not None,
                    status.value if status is not None else None,
                    len(request.prompt_token_ids),
                    [logprob] if logprob is not None else [],
                )
            )
