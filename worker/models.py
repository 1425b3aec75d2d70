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


# Room left beside the weights on the device they are placed on (activations, the engine's workspace).
PLACEMENT_HEADROOM = 1.2
QUANTIZED_FRACTION = {"4bit": 0.3, "8bit": 0.55}  # of the unquantized size, norms and embeddings included


def model_bytes(name: str, settings: Settings, dtype) -> int:
    """The weights' size at `dtype`, from the config alone (meta tensors: nothing is read or allocated)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_source(name, settings), trust_remote_code=settings.trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=settings.trust_remote_code)
    model.tie_weights()  # as from_pretrained does: tied embeddings count once
    return sum(p.numel() * p.element_size() for p in model.parameters())


def inference_placement(name: str, settings: Settings, backend: str, dtype, quantization: str):
    """One device when the model fits the first device's free memory (the native engine serves it there);
    spread over the node's group (`device_map="auto"`) only when it does not."""
    visible = devices.describe(backend)
    one_device = {"": devices.torch_device(backend)}
    if len(visible) < 2:
        return one_device
    try:
        need = model_bytes(name, settings, dtype) * QUANTIZED_FRACTION.get(quantization, 1.0)
    except (OSError, ValueError):
        return one_device  # the load itself reports what is wrong with the model
    return one_device if need * PLACEMENT_HEADROOM <= visible[0]["free_memory"] else "auto"


def kernel_config(settings: Settings, backend: str):
    """The KernelConfig for use_kernels: the configured per-device mapping (the "xpu" key on Intel GPUs, as
    the guide chooses kernels), or None for transformers' own mapping. A mapping with no entry for this device
    would swap nothing here: that is refused rather than run silently without kernels."""
    if not settings.kernel_mapping:
        return None
    from transformers import KernelConfig

    for layer, kernel in settings.kernel_mapping.items():
        if isinstance(kernel, dict) and backend not in kernel:
            raise ModelLoadError("kernels_unavailable", f"XPUJOBS_KERNEL_MAPPING has no '{backend}' kernel for "
                                                        f"{layer} (it has {', '.join(sorted(kernel))})")
    return KernelConfig(settings.kernel_mapping)


def load_model_and_tokenizer(name: str, settings: Settings, backend: str, *, attn_implementation: str = "sdpa",
                             quantization: str = "none", use_kernels: bool = False, for_training: bool = False,
                             shard_over: int = 1):
    """shard_over > 1: the base is sharded at load over that many processes (FSDP2 through transformers'
    DistributedConfig, the process group already up), each rank holding its shard on its own device."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if attn_implementation == "flash_attention_2" and backend == "cpu":
        raise ModelLoadError("unsupported_attention", "attn_implementation 'flash_attention_2' needs an XPU or "
                                                      "CUDA device; this worker runs on cpu. Use 'sdpa' or 'eager'.")
    dtype = devices.compute_dtype(backend)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation,
              "trust_remote_code": settings.trust_remote_code}
    if for_training:
        # Training needs no KV cache, and with one (the config's use_cache) transformers builds no packed-sequence
        # mask from position ids: packed examples would attend to each other under sdpa and eager attention.
        kwargs["use_cache"] = False
    if use_kernels:
        kwargs["use_kernels"] = True
        kwargs["kernel_config"] = kernel_config(settings, backend)
    if quantization == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True)
    elif quantization == "8bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    if shard_over > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(fsdp_size=shard_over)
    elif backend == "cpu":
        kwargs["device_map"] = {"": "cpu"}
    elif for_training:
        kwargs["device_map"] = {"": devices.rank_device(backend)}
    else:
        kwargs["device_map"] = inference_placement(name, settings, backend, dtype, quantization)
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
