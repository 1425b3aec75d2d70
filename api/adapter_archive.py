"""LoRA adapters in and out of the service as zip archives of a standard PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`), which `PeftModel.from_pretrained` loads as is once extracted.

An uploaded archive is checked without torch (the API never imports it): safetensors weights only, a LoRA
config, the base it names, and every tensor's shape against the base's config.json.
"""

import io
import json
import re
import struct
import zipfile
from pathlib import Path

from api.errors import invalid

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Files PEFT and tokenizers write next to an adapter: allowed in an upload, not used (the base's tokenizer serves).
SIDE_FILES = {"README.md", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json"}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def pack(directory: Path) -> bytes:
    """A zip of the adapter's two files, at the archive's top level."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name in ADAPTER_FILES:
            archive.write(directory / name, name)
    return buffer.getvalue()


def _bad(message: str) -> Exception:
    return invalid(f"The adapter archive is not usable: {message}", param="adapter_file", code="invalid_adapter")


def _members(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """Adapter files by name; a single top-level folder is allowed. Anything that is not safetensors weights,
    a config or a side file is refused."""
    found = {}
    for info in archive.infolist():
        if info.is_dir():
            continue
        name = info.filename.rsplit("/", 1)[-1]
        if info.filename.count("/") > 1 or info.filename.startswith(("/", "..")) or ".." in info.filename:
            raise _bad(f"'{info.filename}' is not at the top of the archive or in one folder")
        if name.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")):
            raise _bad(f"'{name}' is a pickle-based weights file; only safetensors is accepted")
        if name not in ADAPTER_FILES and name not in SIDE_FILES:
            raise _bad(f"unexpected file '{name}' (expected {', '.join(ADAPTER_FILES)})")
        found[name] = info
    missing = [n for n in ADAPTER_FILES if n not in found]
    if missing:
        raise _bad(f"it lacks {', '.join(missing)}")
    return found


def _expected_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-able linear layer of a Llama-style decoder (Llama, Qwen, Mistral)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise _bad("adapter_model.safetensors is not a safetensors file")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        raise _bad("adapter_model.safetensors is not a safetensors file")
    try:
        header = json.loads(data[8:8 + length])
    except ValueError:
        raise _bad("adapter_model.safetensors has an unreadable header") from None
    header.pop("__metadata__", None)
    return header


def unpack(data: bytes, base: str, base_config: dict) -> tuple[dict[str, bytes], dict]:
    """The adapter's two files and its LoRA config, checked against the base; a 400 naming the problem."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise _bad("it is not a zip archive") from None
    with archive:
        members = _members(archive)
        files = {name: archive.read(members[name]) for name in ADAPTER_FILES}
    try:
        config = json.loads(files["adapter_config.json"])
    except ValueError:
        raise _bad("adapter_config.json is not JSON") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise _bad("adapter_config.json is not a LoRA config (peft_type LORA)")
    named = str(config.get("base_model_name_or_path") or "")
    if named and named.rstrip("/").rsplit("/", 1)[-1] != base.rstrip("/").rsplit("/", 1)[-1]:
        raise _bad(f"it was trained for '{named}', not '{base}'")
    if config.get("modules_to_save"):
        raise _bad("modules_to_save is not supported (only LoRA matrices)")
    rank, layers = config.get("r"), base_config.get("num_hidden_layers", 0)
    expected = _expected_shapes(base_config)
    header = _header(files["adapter_model.safetensors"])
    if not header:
        raise _bad("adapter_model.safetensors holds no tensors")
    for key, tensor in header.items():
        match = _TENSOR.match(key)
        if not match or match.group(2) not in expected:
            raise _bad(f"tensor '{key}' is not a LoRA matrix of a layer this base has")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        features_in, features_out = expected[module]
        want = [rank, features_in] if side == "A" else [features_out, rank]
        if layer >= layers or tensor.get("shape") != want:
            raise _bad(f"tensor '{key}' has shape {tensor.get('shape')}; this base needs {want}"
                       + (f" (it has {layers} layers)" if layer >= layers else ""))
    return files, config
