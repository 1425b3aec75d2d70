"""Inference request bodies (OpenAI's shapes plus documented extensions) and their normal form.

The API validates live requests with them and the workers validate batch lines with the same schemas; both
turn a body into one normal form: {model, messages | prompt, max_tokens, temperature, top_p, seed, stop,
attn_implementation}, plus the options of contract/inference_options.py (structured outputs, tools, logprobs,
penalties).
"""

from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, StringConstraints, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.inference_options import ChatOptions, CompletionOptions, ResponseOptions, Strict

Attention = Literal["sdpa", "eager", "flash_attention_2"]
# OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                          Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)]
DEFAULT_MAX_TOKENS = 256
# Content parts a text-only model reads: chat's "text", the Responses API's "input_text" and (in earlier turns)
# "output_text".
TEXT_PARTS = ("text", "input_text", "output_text")


def text_of(content: str | list[dict]) -> str:
    """Message content as plain text; OpenAI's content parts carry text under 'text'."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


class CalledFunction(Strict):
    name: str
    arguments: str


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    type: Literal["message"] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        # An image or audio part silently dropped would answer a different question than the one asked.
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "unsupported_content", "content parts must be text ({kinds}); the served models read text "
                    "only, so a '{kind}' part cannot be used", {"kinds": ", ".join(TEXT_PARTS), "kind": kind})
        return content

    def normal(self) -> dict:
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": None if self.content is None else text_of(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionCallItem(Strict):
    """A Responses input item: a call the model made in an earlier turn."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """A Responses input item: a function's result, answering the call with the same call_id."""
    type: Literal["function_call_output"]
    call_id: str
    output: str


def _item_kind(item) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return {"function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem"}.get(kind, "Message")


# A Responses input item, validated as the kind its "type" names (a message when it names none), so a bad message
# is reported as one rather than as a failed function call.
InputItem = Annotated[Annotated[FunctionCallItem, Tag("FunctionCallItem")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
                      | Annotated[Message, Tag("Message")], Discriminator(_item_kind)]


def response_messages(items: list) -> list[dict]:
    """Responses input items as chat messages: consecutive function calls become one assistant message with
    tool_calls, each output a tool message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            messages.append(item.normal())
    return messages


def unencodable(value) -> bool:
    """True if any string inside cannot be UTF-8 (a lone surrogate from JSON's \\ud800 escapes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(unencodable(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(unencodable(v) for v in value)
    return False


class Sampling(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _text_is_utf8(cls, data):
        if unencodable(data):
            raise ValueError("text must be valid Unicode (a lone surrogate such as \\udcff cannot be encoded)")
        return data

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # int64, as torch's generators take it (with room for seed + choice index).
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    # None: the engine's own fused kernels (its native path where the architecture allows). A value asks for the
    # Hugging Face path with that attention, as loading a model with it would.
    attn_implementation: Attention | None = None
    # Extension (as in vLLM): keep generating past end-of-sequence until the token limit (benchmarks).
    ignore_eos: bool = False
    # Extensions: load the base in bitsandbytes 4- or 8-bit, and swap in the Hub's kernels (use_kernels=True).
    # None: the plain base, or for an adapter trained on a quantized base (QLoRA) as settings.qlora_serve_on says.
    quantization: Literal["none", "4bit", "8bit"] | None = None
    use_kernels: bool = False

    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "attn_implementation": self.attn_implementation, "ignore_eos": self.ignore_eos,
                "quantization": self.quantization, "use_kernels": self.use_kernels}


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else (stop or [])


class ResponseCreate(Sampling, ResponseOptions):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=32768)
    background: bool = False
    metadata: Metadata | None = None

    def normal(self) -> dict:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += response_messages(self.input)
        return {"model": self.model, "messages": messages, "stop": [],
                "max_tokens": self.max_output_tokens or DEFAULT_MAX_TOKENS, **self.sampling(), **self.options()}


class ChatCompletionCreate(Sampling, ChatOptions):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: Literal[False] = False

    def normal(self) -> dict:
        return {"model": self.model, "messages": [m.normal() for m in self.messages], "stop": _stops(self.stop),
                "max_tokens": self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
                **self.sampling(), **self.options()}


class CompletionCreate(Sampling, CompletionOptions):
    model: str
    prompt: str | list[int] = Field(description="text, or token ids as OpenAI's completions accept")
    max_tokens: int | None = Field(None, ge=1, le=32768)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: Literal[False] = False

    def normal(self) -> dict:
        return {"model": self.model, "prompt": self.prompt, "stop": _stops(self.stop),
                "max_tokens": self.max_tokens or 16, **self.sampling(), **self.options()}


BODY_SCHEMAS = {"/v1/chat/completions": ChatCompletionCreate, "/v1/responses": ResponseCreate,
                "/v1/completions": CompletionCreate}
