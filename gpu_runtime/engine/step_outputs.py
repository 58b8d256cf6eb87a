"""A step's `RequestOutput`s: the stop rules applied to each sampled request, and the requests
the scheduler dropped without running. A constrained request's matcher accepts its sampled token
here, once per token, before the stop rules: a grammar that has ended stops the request
("stop"), and its matcher is released with the request."""

from __future__ import annotations

from gpu_runtime.engine.fanout import sequence_ids
from gpu_runtime.engine.request import RequestOutput, RequestStatus
from gpu_runtime.engine.runner_types import ModelRunnerOutput
from gpu_runtime.engine.scheduler import Scheduler
from gpu_runtime.engine.stopping import StopChecker
from gpu_runtime.structured.outputs import Acceptance, StructuredOutputs


class StepOutputs:
    """Builds outputs from the scheduler's requests; finishes those a stop rule ends."""

    def __init__(
        self,
        scheduler: Scheduler,
        stop_checker: StopChecker,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.stop_checker = stop_checker
        self.structured = structured

    def rejected(self) -> list[RequestOutput]:
        """One failed output per request the scheduler dropped since the last call."""
        dropped = self.scheduler.take_rejected()
        if self.structured is not None:
            for r in dropped:
                for sequence in {r.request_id, *sequence_ids(r.request_id, r.fan_out)}:
                    self.structured.release(sequence)
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
                parent_id=r.parent_id,
                index=r.index,
            )
            for r in dropped
        ]

    def sampled(self, result: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        """Stop rules and one output per sampled request still live (its token already in the
        scheduler's request), appended to `outputs`."""
        scheduler = self.scheduler
        get_request, check = scheduler.get_request, self.stop_checker.check
        logprobs = result.logprobs
        structured = self.structured
        for request_id, token in result.sampled.items():
            request = get_request(request_id)
            if request is None:
                continue  # finished or aborted after its step was launched
            grammar = (
                structured.accept(request_id, token)
                if structured is not None and structured.num_matchers
                else Acceptance.CONTINUE
            )
            text, status, reason = check(request)
            error = None
            if grammar is Acceptance.REJECTED:
                status, reason = RequestStatus.FINISHED_ABORTED, token
                error = f"structured output: sampled token {token} is not allowed by the grammar"
            elif grammar is Acceptance.TERMINATED and status is None:
                status, reason = RequestStatus.FINISHED_STOPPED, token
            if status is not None:
                scheduler.finish_request(request_id, status)
                request.stop_reason = reason
                if structured is not None:
                    structured.release(request_id)
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
                    error=error,
                    num_cached_tokens=request.num_cached_tokens,
                    parent_id=request.parent_id,
                    index=request.index,
                    prompt_logprobs=request.prompt_logprobs,
                )
            )

    def record_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        """Append a step's prompt logprobs to their requests' lists; entries of positions a
        request already holds (recomputed after a preemption) are skipped."""
        get_request = self.scheduler.get_request
        for request_id, entries in result.prompt_logprobs.items():
            request = get_request(request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            held = request.prompt_logprobs
            for position, entry in entries:  # `entry` is the logprob of token `position`
                if position == len(held):
                    held.append(entry)
