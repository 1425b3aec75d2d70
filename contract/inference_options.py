"""Request fields beyond plain generation, in OpenAI's shapes: structured outputs (`response_format`, Responses'
`text.format`), tools and `tool_choice`, logprobs, presence/frequency penalties and `logit_bias`. Each request
class mixes in its endpoint's set; `options()` gives their part of the normal form:

    response_format: None | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict"}
    tools: [{"name", "description", "parameters", "strict"}], tool_choice: "auto" | "none" | "required" | <name>,
    parallel_tool_calls: bool, logprobs: None | <top count>, presence_penalty, frequency_penalty,
    logit_bias: [[token id, bias], ...] (pairs: the normal form travels as JSON)
"""

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
)

MAX_TOP_LOGPROBS = 20
# A schema is compiled into a grammar on a worker: its size is bounded so none can tie one up for long.
MAX_SCHEMA_BYTES = 64 * 1024
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = dict[Annotated[str, StringConstraints(pattern=r"^\d{1,9}$")], Annotated[float, Field(ge=-100, le=100)]]


class Strict(BaseModel):
    """A nested object: a field OpenAI does not define in it is refused, never ignored."""
    model_config = ConfigDict(extra="forbid")


def _bounded(schema: dict | None) -> dict | None:
    if schema is not None and len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"a JSON schema may be at most {MAX_SCHEMA_BYTES} bytes")
    return schema


Schema = Annotated[dict[str, Any] | None, AfterValidator(_bounded)]


class JSONSchemaSpec(Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Schema = Field(None, alias="schema")
    strict: bool | None = False


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class ResponsesJSONSchemaFormat(JSONSchemaSpec):
    """Responses' text.format is flat: {"type": "json_schema", "name", "schema", "strict"}."""
    type: Literal["json_schema"]


def _format_kind(fmt) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else getattr(fmt, "type", None)
    return {"text": "TextFormat", "json_object": "JSONObjectFormat", "json_schema": "JSONSchemaFormat"}.get(kind)


_FORMAT_KIND = Discriminator(_format_kind, custom_error_type="invalid_value",
                             custom_error_message="type must be 'text', 'json_object' or 'json_schema'")
# Validated as the kind its "type" names; the tags are class names, which error locations leave out of `param`.
ChatFormat = Annotated[Annotated[TextFormat, Tag("TextFormat")] | Annotated[JSONObjectFormat, Tag("JSONObjectFormat")]
                       | Annotated[JSONSchemaFormat, Tag("JSONSchemaFormat")], _FORMAT_KIND]
ResponsesFormat = Annotated[Annotated[TextFormat, Tag("TextFormat")]
                            | Annotated[JSONObjectFormat, Tag("JSONObjectFormat")]
                            | Annotated[ResponsesJSONSchemaFormat, Tag("JSONSchemaFormat")],
                            _FORMAT_KIND]


def _format(fmt) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = fmt.json_schema if isinstance(fmt, JSONSchemaFormat) else fmt
    return {"type": "json_schema", "name": spec.name, "schema": spec.schema_ or {}, "strict": bool(spec.strict)}


class FunctionSpec(Strict):
    name: FunctionName
    description: str | None = None
    parameters: Schema = None
    strict: bool | None = False


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class ResponsesTool(FunctionSpec):
    type: Literal["function"]


class NamedFunction(Strict):
    name: FunctionName


class ChatToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponsesToolChoice(Strict):
    type: Literal["function"]
    name: FunctionName


def _unique(cls, tools: list | None) -> list | None:
    names = [(t.function if isinstance(t, ChatTool) else t).name for t in tools or []]
    if len(set(names)) != len(names):
        raise ValueError("function names in tools must be unique")
    return tools


def _tools(tools: list, choice, parallel: bool) -> dict:
    specs = [(t.function if isinstance(t, ChatTool) else t) for t in tools or []]
    names = [s.name for s in specs]
    if isinstance(choice, ChatToolChoice):
        choice = choice.function.name
    elif isinstance(choice, ResponsesToolChoice):
        choice = choice.name
    choice = choice or ("auto" if specs else "none")
    if choice not in ("auto", "none", "required") and choice not in names:
        raise ValueError(f"there is no function named '{choice}' in tools")
    if choice == "required" and not specs:
        raise ValueError("'required' needs at least one function in tools")
    return {"tools": [{"name": s.name, "description": s.description, "parameters": s.parameters,
                       "strict": bool(s.strict)} for s in specs],
            "tool_choice": choice, "parallel_tool_calls": parallel}


class _Penalties(BaseModel):
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None

    def _penalties(self) -> dict:
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "logit_bias": [[int(k), v] for k, v in (self.logit_bias or {}).items()]}


class ChatOptions(_Penalties):
    response_format: ChatFormat | None = None
    tools: list[ChatTool] | None = None
    unique_tools = field_validator("tools")(_unique)
    tool_choice: Literal["none", "auto", "required"] | ChatToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice, info: ValidationInfo):
        _tools(info.data.get("tools"), choice, True)
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, top, info: ValidationInfo):
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    def options(self) -> dict:
        return {"response_format": _format(self.response_format),
                **_tools(self.tools, self.tool_choice, self.parallel_tool_calls),
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None, **self._penalties()}


class ResponseText(Strict):
    format: ResponsesFormat | None = None


class ResponseOptions(BaseModel):
    text: ResponseText | None = None
    tools: list[ResponsesTool] | None = None
    unique_tools = field_validator("tools")(_unique)
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None

    @field_validator("include")
    @classmethod
    def _includable(cls, include):
        if unknown := sorted(set(include or []) - {"message.output_text.logprobs"}):
            raise ValueError(f"only 'message.output_text.logprobs' can be included, not {unknown}")
        return include

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice, info: ValidationInfo):
        _tools(info.data.get("tools"), choice, True)
        return choice

    def options(self) -> dict:
        # OpenAI returns logprobs when include asks for them; top_logprobs alone also implies them.
        wanted = "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None
        return {"response_format": _format(self.text.format if self.text else None),
                **_tools(self.tools, self.tool_choice, self.parallel_tool_calls),
                "logprobs": (self.top_logprobs or 0) if wanted else None,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": []}


class CompletionOptions(_Penalties):
    logprobs: int | None = Field(None, ge=0, le=5)

    def options(self) -> dict:
        return {"response_format": None, "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
                "logprobs": self.logprobs, **self._penalties()}
