"""Model placement: the weights' size is known from the config alone, before anything is loaded."""

import pytest
import torch

from contract.settings import Settings
from worker.demo_model import build_demo_model
from worker.models import load_model_and_tokenizer, model_bytes


def test_model_bytes_from_the_config_match_the_loaded_weights(tmp_path):
    build_demo_model(tmp_path / "demo-tiny")
    settings = Settings(models_root=tmp_path)
    model, _ = load_model_and_tokenizer("demo-tiny", settings, "cpu")
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes("demo-tiny", settings, torch.float32) == loaded
    assert model_bytes("demo-tiny", settings, torch.bfloat16) == loaded // 2


def test_use_kernels_takes_the_configured_per_device_mapping():
    from transformers import KernelConfig

    from worker.models import ModelLoadError, kernel_config

    assert kernel_config(Settings(), "xpu") is None  # transformers' own mapping, xpu entries included
    mapping = {"RMSNorm": {"xpu": "kernels-community/rmsnorm:RMSNorm", "cuda": "kernels-community/rmsnorm:RMSNorm"}}
    config = kernel_config(Settings(kernel_mapping=mapping), "xpu")
    assert isinstance(config, KernelConfig) and config.kernel_mapping == mapping
    with pytest.raises(ModelLoadError, match="no 'xpu' kernel for RMSNorm"):
        kernel_config(Settings(kernel_mapping={"RMSNorm": {"cuda": "kernels-community/rmsnorm:RMSNorm"}}), "xpu")
