from typing import Literal

from pydantic import BaseModel, Field

Attention = Literal["sdpa", "eager", "flash_attention_2"]


class InputMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]
    type: Literal["message"] | None = None


class ResponseCreate(BaseModel):
    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    attn_implementation: Attention = "sdpa"


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]


class ChatCompletionCreate(BaseModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: Literal[False] = False
    attn_implementation: Attention = "sdpa"
