"""The base of request bodies: a field the service does not know is refused (400 `unknown_parameter`, naming it)
rather than ignored, and a value of the wrong JSON type is refused rather than coerced (`true` is not 1,
"yes" is not a boolean; an integer is still accepted where a number is expected)."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
