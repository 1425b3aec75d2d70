"""POST /v1/chat/completions: the request as OpenAI's reference defines it, each field honoured or refused."""


from pydantic import BaseModel, Field, model_validator

from api.protocol import common
from api.protocol.common import MAX_CHOICES, STRICT, Stop, invalid_field, refused
from contract.inference_requests import ChatCompletionCreate


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: refused("obfuscation padding is not added to stream events", False) = None


def check_stream_options(model: str, stream: bool, options) -> None:
    if options is not None and not stream:
        raise invalid_field(model, "stream_options", "stream_options is only allowed when stream is true")


class ChatCompletionRequest(ChatCompletionCreate):
    model_config = STRICT

    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    service_tier: refused(common.ONE_TIER, "auto", "default") = None
    store: refused(common.NOT_STORED, False) = None
    metadata: refused("metadata is kept with stored chat completions, and this service stores none", {}) = None
    modalities: refused(common.NO_AUDIO, ["text"]) = None
    audio: refused(common.NO_AUDIO) = None
    prediction: refused("predicted outputs are not supported") = None
    reasoning_effort: refused(common.NO_REASONING) = None
    verbosity: refused("verbosity is not supported: the output length follows max_completion_tokens") = None
    web_search_options: refused("web search is not available") = None
    moderation: refused(common.NO_MODERATION) = None
    prompt_cache_key: refused(common.NO_CACHE_HINTS) = None
    prompt_cache_retention: refused(common.NO_CACHE_HINTS) = None
    prompt_cache_options: refused(common.NO_CACHE_HINTS) = None
    functions: refused(common.NO_TOOLS, []) = None
    function_call: refused(common.NO_TOOLS, "none") = None

    @model_validator(mode="after")
    def _stream_options(self):
        check_stream_options(type(self).__name__, self.stream, self.stream_options)
        return self

    def normal(self) -> dict:
        return {**super().normal(), "n": self.n, "stream": self.stream}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

