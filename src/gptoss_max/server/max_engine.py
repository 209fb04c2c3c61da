"""The `Engine` protocol over MAX's serving pipeline (continuous batching in MAX's worker).

`app.state.pipeline` is MAX's `TokenGeneratorPipeline`, set by MAX's `lifespan`. Prompts
go in as token ids (used as is); `next_token_chunk(..., parse_reasoning=False)` streams
`TokenGeneratorOutput.token_ids`, special tokens included. Leaving the stream early
cancels the request in the worker (MAX does this when its stream is closed; we also send
the cancel ourselves, so it never depends on garbage collection). A grammar goes in as a
`response_format` of type "grammar", enforced from the first token; the worker compiles it
and masks each step's logits (this needs `enable_structured_output`, see server/cli.py).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from gptoss_max.server.engine import Chunk, GenParams, PromptTooLong, QueueFull, Rejected

logger = logging.getLogger("gptoss_max.server")


class MaxEngine:
    def __init__(self, app: Any, model_name: str, max_context: int, sampling_defaults: Any = None):
        self._app = app
        self.model_name = model_name
        self.max_context = max_context
        self._defaults = sampling_defaults

    @property
    def pipeline(self) -> Any:
        return self._app.state.pipeline

    def _request(self, prompt_ids: list[int], params: GenParams) -> Any:
        from max.pipelines.context import SamplingParams, SamplingParamsInput, TextGenerationResponseFormat
        from max.pipelines.context.sampling_params import SamplingParamsGenerationConfigDefaults
        from max.pipelines.modeling.types import RequestID, TextGenerationRequest

        sampling = SamplingParams.from_input_and_generation_config(
            SamplingParamsInput(
                temperature=params.temperature,
                top_p=params.top_p,
                max_new_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
                seed=params.seed if params.seed is not None else secrets.randbits(32),
            ),
            sampling_params_defaults=self._defaults or SamplingParamsGenerationConfigDefaults(),
        )
        grammar = None
        if params.grammar is not None:
            grammar = TextGenerationResponseFormat(type="grammar", grammar=params.grammar, grammar_enforced=True)
        return TextGenerationRequest(
            request_id=RequestID(),
            model_name=self.model_name,
            prompt=list(prompt_ids),
            sampling_params=sampling,
            response_format=grammar,
        )

    async def generate(self, prompt_ids: list[int], params: GenParams) -> AsyncIterator[list[int]]:
        from max.pipelines.context import InputError, PromptTooLongError
        from max.serve.worker_interface import RequestQueueFull

        request = self._request(prompt_ids, params)
        try:
            outputs = await self.pipeline.next_token_chunk(request, parse_reasoning=False)
        except RequestQueueFull:
            raise QueueFull() from None
        except PromptTooLongError as exc:
            raise PromptTooLong(str(exc)) from None
        except InputError as exc:
            raise Rejected(str(exc)) from None
        except BaseException:  # cancelled while submitting: the worker may have it already
            with contextlib.suppress(Exception):
                self.pipeline.model_worker.cancel(request.request_id)
            raise
        finished, first = False, True
        try:
            async for out in _refusals_as(outputs, InputError):
                chunk = Chunk(out.token_ids or [])
                if first:
                    chunk.cached_tokens = out.cached_token_count or 0
                    first = False
                finished = out.status.is_done
                yield chunk
            finished = True
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    self.pipeline.model_worker.cancel(request.request_id)
            with contextlib.suppress(Exception):
                await outputs.aclose()


async def _refusals_as(outputs: AsyncIterator[Any], refusal: type[Exception]) -> AsyncIterator[Any]:
    """The worker's refusal of a request (its grammar does not compile) comes as the stream's
    first item; it becomes `Rejected` (a 400). A later error is a failure mid-generation."""
    first = True
    while True:
        try:
            out = await anext(outputs)
        except StopAsyncIteration:
            return
        except refusal as exc:
            if first:
                raise Rejected(str(exc)) from None
            raise
        first = False
        yield out
