"""Model placement: the weights' size is known from the config alone, before anything is loaded."""

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
