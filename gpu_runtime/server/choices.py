"""A prompt's choices on the completion routes.

One engine request per prompt generates `n` sequences (the engine's fan-out: one prefill, n
children), or `best_of` candidates of which the `n` with the highest cumulative logprob are
returned, highest first (the `best_of` of OpenAI's legacy completions and of vLLM's V0
engine; vLLM's V1 dropped it). In a response, prompt `i`'s choice `j` has index `i * n + j`
(prompt-major, as OpenAI orders them). Echo prepends the prompt's text to each choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from gpu_runtime.engine.request import RequestOutput, TokenLogprob
from gpu_runtime.server.responses import Tracked


@dataclass
class PromptRun:
    """One prompt's engine request: its ids, the text echo prepends ("" without echo) and one
    `Tracked` per sequence generated (indexed by `RequestOutput.index`)."""

    ids: list[int]
    echo: str
    sequences: list[Tracked]

    @classmethod
    def start(cls, ids: list[int], sequences: int, echo: str) -> PromptRun:
        """A run of `sequences` sequences over `ids`, their clocks started now."""
        return cls(ids, echo, [Tracked(len(ids)) for _ in range(sequences)])

    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs (asked with `SamplingParams.prompt_logprobs`), or None."""
        for seq in self.sequences:
            if seq.last is not None and seq.last.prompt_logprobs is not None:
                return seq.last.prompt_logprobs
        return None


def cumulative_logprob(seq: Tracked) -> float:
    """Sum of the logprobs of the tokens `seq` sampled (raw distribution)."""
    return sum(lp.logprob for lp in seq.logprobs)


def best(sequences: list[Tracked], n: int) -> list[Tracked]:
    """The choices returned: all `n` in order when no more were generated; else the `n` of
    highest cumulative logprob, highest first (ties in generation order)."""
    if len(sequences) == n:
        return sequences
    ranked = sorted(range(len(sequences)), key=lambda i: -cumulative_logprob(sequences[i]))
    return [sequences[i] for i in ranked[:n]]


async def merge_streams(
    heads: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
) -> AsyncGenerator[tuple[int, RequestOutput | None], None]:
    """`(prompt index, output)` of several prompts' streams as they come (each stream's
    `heads` entry first, already read from it), then `(i, None)` once stream `i` ended; the
    pumps are cancelled when the consumer stops."""
    merged: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        await merged.put((i, heads[i]))
        async for out in streams[i]:
            await merged.put((i, out))
        await merged.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    open_streams = len(streams)
    try:
        while open_streams:
            item = await merged.get()
            if item[1] is None:
                open_streams -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
