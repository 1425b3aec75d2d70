"""POST /v1/completions (the legacy text completions): the request as OpenAI's reference defines it, each field
honoured or refused."""

from typing import Annotated

from pydantic import Field, model_validator

from api.protocol.chat import StreamOptions, check_stream_options
from api.protocol.common import MAX_CHOICES, STRICT, Stop, invalid_field, refused
from contract.inference_requests import CompletionCreate

TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(CompletionCreate):
    model_config = STRICT

    # One prompt (text or token ids) or several, each answered by n choices.
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: str | None = Field(None, max_length=256)
    suffix: refused("suffix (fill in the middle) is not supported by the served models") = None

    @model_validator(mode="after")
    def _consistent(self):
        name = type(self).__name__
        check_stream_options(name, self.stream, self.stream_options)
        if self.best_of is not None and self.best_of != self.n:
            # Choosing the best of several needs their logprobs ranked; only best_of == n (all of them) is honest.
            raise invalid_field(name, "best_of", "best_of other than n is not supported", self.best_of)
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise invalid_field(name, "n", f"the number of prompts times n may be at most {MAX_CHOICES}", self.n)
        if self.echo and not all(isinstance(p, str) for p in self.prompts()):
            raise invalid_field(name, "echo", "echo is supported for text prompts only", self.echo)
        if self.echo and self.logprobs is not None:
            raise invalid_field(name, "logprobs", "logprobs with echo (the prompt's own logprobs) are not supported",
                                self.logprobs)
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def normal(self) -> dict:
        normal = {**super().normal(), "n": self.n, "stream": self.stream}
        if len(prompts := self.prompts()) > 1:
            normal["prompts"] = prompts
            del normal["prompt"]
        return normal

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
