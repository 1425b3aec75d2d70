"""What the live inference protocols (chat, responses, completions) share: strictness and refused fields.

Every field OpenAI's reference defines for an endpoint is declared on its request model, either honoured or
`refused(...)`: a 400 naming it whenever the client sends something other than the neutral value. Fields OpenAI
does not define are refused too (extra="forbid"), so nothing a client sends is accepted and ignored.
"""

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

# Most choices one request may ask for (chat `n`, completions `n` x prompts): each is a sequence in the engine.
MAX_CHOICES = 8
# Unknown fields refused, and values of the wrong JSON type too (not coerced: `"yes"` is no boolean, `true` no 1).
STRICT = ConfigDict(extra="forbid", strict=True)


def refused(why: str, *neutral: Any) -> Any:
    """A field accepted only at its neutral value(s) (None always): anything else is a 400 naming the field that
    says `why`."""
    def check(value):
        if value is None or any(value == n for n in neutral):
            return value
        raise PydanticCustomError("unsupported_value", why)

    return Annotated[Any, AfterValidator(check)]


def _at_most_four(stop):
    if isinstance(stop, list) and len(stop) > 4:
        raise PydanticCustomError("invalid_value", "at most 4 stop sequences")
    return stop


# OpenAI's `stop`: one string or up to four.
Stop = Annotated[str | list[str] | None, AfterValidator(_at_most_four)]


def invalid_field(model: str, param: str, message: str, value: Any = None) -> ValidationError:
    """A validation error located at `param`, for checks across fields (a model validator's own errors name no
    field, and OpenAI's error names one)."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(
        type=PydanticCustomError("invalid_value", message), loc=(param,), input=value)])


NOT_STORED = "this service keeps no stored chat completions, so only store=false is accepted"
NO_TOOLS = "the deprecated functions and function_call are not supported: use tools and tool_choice"
NO_AUDIO = "the served models read and write text only"
NO_REASONING = "the served models have no reasoning settings"
ONE_TIER = "there is one service tier: accepted values are 'auto' and 'default'"
NO_CACHE_HINTS = "prompt caching hints are not supported: the engine keeps no prompt cache between requests"
NO_MODERATION = "this service runs no moderation"
