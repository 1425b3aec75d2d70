"""POST /v1/responses: the request as OpenAI's reference defines it, each field honoured or refused."""

from pydantic import BaseModel, Field, model_validator

from api.protocol import common
from api.protocol.common import STRICT, invalid_field, refused
from contract.inference_requests import ResponseCreate, response_messages


class StreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: refused("obfuscation padding is not added to stream events", False) = None


class ResponseRequest(ResponseCreate):
    model_config = STRICT

    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    service_tier: refused(common.ONE_TIER, "auto", "default") = None
    truncation: refused("only truncation='disabled' is supported: a conversation longer than the model's context "
                        "is a 400", "disabled") = None
    reasoning: refused(common.NO_REASONING, {}) = None
    conversation: refused("conversation objects are not supported; continue with previous_response_id") = None
    prompt: refused("prompt templates are not supported") = None
    context_management: refused("context management is not supported", []) = None
    background_options: refused("background options are not supported") = None
    access_programs: refused("access programs are not supported") = None
    image: refused(common.NO_AUDIO) = None
    moderation: refused(common.NO_MODERATION) = None
    prompt_cache_key: refused(common.NO_CACHE_HINTS) = None
    prompt_cache_retention: refused(common.NO_CACHE_HINTS) = None
    prompt_cache_options: refused(common.NO_CACHE_HINTS) = None
    max_tool_calls: refused("max_tool_calls is not supported: parallel_tool_calls=false allows one call") = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.background and not self.store:
            raise invalid_field("ResponseRequest", "store", "background responses must be stored: send store=true")
        if self.stream_options is not None and not self.stream:
            raise invalid_field("ResponseRequest", "stream_options", "stream_options is only allowed when stream is "
                                "true")
        return self

    def input_messages(self) -> list[dict]:
        """This request's own input, in normal form (without instructions and earlier turns)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return response_messages(self.input)

    def normal_with(self, history: list[dict]) -> dict:
        """The normal form, continuing `history` (the earlier turns of previous_response_id, without their
        instructions, which OpenAI does not carry over)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**self.normal(), "messages": system + history + self.input_messages(), "stream": self.stream}
