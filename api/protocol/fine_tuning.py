from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.inference_requests import Metadata

Auto = Literal["auto"]


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_epochs: int | Auto = Field("auto", description="int 1-50")
    batch_size: int | Auto = "auto"
    learning_rate_multiplier: float | Auto = "auto"


class Supervised(BaseModel):
    hyperparameters: Hyperparameters | None = None


class Method(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: Supervised | None = None


class LoraOptions(BaseModel):
    """Extension: the LoRA adapter's shape."""
    model_config = ConfigDict(extra="forbid")
    r: int = Field(16, ge=1, le=512)
    alpha: int = Field(32, ge=1, le=4096)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class FineTuningJobCreate(BaseModel):
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = None
    metadata: Metadata | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    # Extensions (send them with the openai client through extra_body).
    lora: LoraOptions = LoraOptions()
    quantization: Literal["none", "4bit", "8bit"] = "none"
    bf16: bool | None = Field(None, description="None: bf16 where the device supports it")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    use_kernels: bool = Field(False, description="swap in the Hub's kernels for supported layers")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    checkpoint_steps: int | None = Field(None, ge=1, description="save a checkpoint every N steps")
