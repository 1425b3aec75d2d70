"""Loading base models and tokenizers for this node's devices, with failures a user can act on."""

from pathlib import Path

from contract.settings import Settings
from worker.node import devices


class ModelLoadError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def model_source(name: str, settings: Settings) -> str:
    """A directory under models_root when there is one, else the Hub id."""
    local = Path(settings.models_root) / name
    return str(local) if local.is_dir() else name


def load_tokenizer(name: str, settings: Settings):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_source(name, settings),
                                                  trust_remote_code=settings.trust_remote_code)
    except OSError as exc:
        raise _unavailable(name, settings, exc) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _unavailable(name: str, settings: Settings, exc: Exception) -> ModelLoadError:
    return ModelLoadError("model_not_available", f"Model '{name}' is not available on this worker (not under "
                                                 f"{settings.models_root} and not fetchable): {exc}")


def load_model_and_tokenizer(name: str, settings: Settings, backend: str, *, attn_implementation: str = "sdpa",
                             quantization: str = "none", use_kernels: bool = False, for_training: bool = False):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if attn_implementation == "flash_attention_2" and backend == "cpu":
        raise ModelLoadError("unsupported_attention", "attn_implementation 'flash_attention_2' needs an XPU or "
                                                      "CUDA device; this worker runs on cpu. Use 'sdpa' or 'eager'.")
    dtype = devices.compute_dtype(backend)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation,
              "trust_remote_code": settings.trust_remote_code}
    if use_kernels:
        kwargs["use_kernels"] = True
    if quantization == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True)
    elif quantization == "8bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    visible = len(devices.describe(backend))
    if backend == "cpu":
        kwargs["device_map"] = {"": "cpu"}
    elif visible > 1 and not for_training:
        kwargs["device_map"] = "auto"  # spread a model too large for one device over the group
    else:
        kwargs["device_map"] = {"": devices.rank_device(backend) if for_training else devices.torch_device(backend)}
    tokenizer = load_tokenizer(name, settings)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_source(name, settings), **kwargs)
    except (ImportError, ValueError) as exc:
        text = str(exc).lower()
        code = "kernels_unavailable" if use_kernels and "kernels" in text else \
            "unsupported_attention" if "attn" in text or "flash" in text else "model_load_failed"
        raise ModelLoadError(code, f"Could not load '{name}' with attn_implementation={attn_implementation!r}, "
                                   f"quantization={quantization!r}, use_kernels={use_kernels} on {backend}: "
                                   f"{exc}") from None
    except OSError as exc:
        raise _unavailable(name, settings, exc) from None
    if not for_training:
        model.eval()
    return model, tokenizer
