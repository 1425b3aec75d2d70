from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from api.protocol.base import StrictModel
from contract.inference_requests import Metadata

Auto = Literal["auto"]


class Hyperparameters(StrictModel):
    n_epochs: int | Auto = Field("auto", description="int 1-50")
    batch_size: int | Auto = "auto"
    learning_rate_multiplier: float | Auto = "auto"


class Supervised(StrictModel):
    hyperparameters: Hyperparameters | None = None


class DpoHyperparameters(Hyperparameters):
    beta: float | Auto = Field("auto", description="above 0, at most 2; auto is 0.1")


class Dpo(StrictModel):
    hyperparameters: DpoHyperparameters | None = None


class Method(StrictModel):
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: Supervised | None = None
    dpo: Dpo | None = None


class LoraOptions(StrictModel):
    """Extension: the LoRA adapter's shape."""
    r: int = Field(16, ge=1, le=512)
    alpha: int = Field(32, ge=1, le=4096)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[Annotated[str, StringConstraints(max_length=128)]] | Literal["all-linear"] = \
        Field("all-linear", max_length=64)


class FineTuningJobCreate(StrictModel):
    model: Annotated[str, StringConstraints(max_length=256)]
    training_file: Annotated[str, StringConstraints(max_length=64)]
    validation_file: Annotated[str, StringConstraints(max_length=64)] | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
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
    gradient_checkpointing: bool | None = Field(None, description="recompute activations in the backward pass to "
                                                                  "save memory; None: on for GPU devices")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="with several training processes: ddp replicates "
                                                                "the model, fsdp shards the base over them (FSDP2)")
    packing: bool = Field(False, description="each batch's examples concatenated into one row without padding, "
                                             "attention kept within each example")
