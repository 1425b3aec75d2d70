"""The engine process's model cache on CPU with two copies of the demo model: a load that finds no room evicts an
idle model, and is refused (model_capacity) rather than closing an engine under its requests; a fine-tune about
to start has the idle ones released."""

import time

import pytest

from contract.settings import Settings
from worker.demo_model import build_demo_model
from worker.engine.messages import ModelKey, Submission
from worker.engine.model_cache import ModelCache, submit
from worker.engine.requests import EngineClosed, GenerationRequest, RequestFailed, SamplingParams


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name in ("demo-a", "demo-b"):
        build_demo_model(root / name)
    return root


def test_a_busy_model_is_not_evicted_until_idle(root):
    probe = ModelCache(Settings(models_root=root, base_models=["demo-a"], _env_file=None), "cpu")
    nbytes = probe.get(ModelKey("demo-a")).nbytes
    probe.close()
    # room for one model's weights only: loading the second needs the first evicted
    cache = ModelCache(Settings(models_root=root, base_models=["demo-a", "demo-b"], model_cache_bytes=nbytes + 1,
                                _env_file=None), "cpu")
    try:
        long = Submission("long", ModelKey("demo-a"), None, [5, 6, 7],
                          SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        engine_a, busy = submit(cache, long)
        deadline = time.time() + 60
        while engine_a.stats["decode_steps"] < 3 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(RequestFailed) as refused:
            cache.get(ModelKey("demo-b"))
        assert refused.value.code == "model_capacity"
        result = busy.result(timeout=120)
        assert result.finish_reason == "length" and result.completion_tokens == 400  # never cut off
        b = cache.get(ModelKey("demo-b")).engine  # demo-a is idle now: it makes way
        assert [m.model for m in cache.report()] == ["demo-b"]
        with pytest.raises(EngineClosed):
            engine_a.submit(GenerationRequest("late", [5], SamplingParams(max_new_tokens=2)))
        assert b.generate([GenerationRequest("b", [5, 6], SamplingParams(max_new_tokens=3, temperature=0,
                                                                         ignore_eos=True))])[0].completion_tokens == 3
        report = cache.report()[0].engine
        assert report["kv_blocks_total"] > 0 and report["kv_blocks_used"] == 0  # what /v1/workers shows
        assert cache.release_idle() == ["demo-b"] and cache.report() == []  # before a fine-tune
    finally:
        cache.close()


def test_an_adapter_request_whose_engine_was_evicted_meanwhile_runs_on_the_reloaded_one(root, tmp_path,
                                                                                        monkeypatch):
    """An eviction between the model's lookup and the request counting as running (another load making room):
    the request goes to the reloaded engine with its adapter attached there too, and gets the adapter's tokens."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from worker.engine.messages import AdapterRef

    torch.manual_seed(3)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "demo-a"),
                          LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():  # deltas large enough to change greedy tokens
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft.save_pretrained(tmp_path / "alpha")
    cache = ModelCache(Settings(models_root=root, base_models=["demo-a"], _env_file=None), "cpu")
    started, evicted = cache.started, []

    def evicted_first(loaded):
        if not evicted:
            evicted.append(cache._evict_idle())
        started(loaded)

    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    try:
        monkeypatch.setattr(cache, "started", evicted_first)
        alpha = AdapterRef("alpha", tmp_path / "alpha")
        _, future = submit(cache, Submission("a", ModelKey("demo-a"), alpha, [5, 6, 7], params))
        result = future.result(timeout=60)
        assert evicted == [ModelKey("demo-a")] and result.error is None, result.error
        assert cache.get(ModelKey("demo-a")).adapters == {"alpha"}
        _, again = submit(cache, Submission("b", ModelKey("demo-a"), alpha, [5, 6, 7], params))
        _, base = submit(cache, Submission("c", ModelKey("demo-a"), None, [5, 6, 7], params))
        assert again.result(timeout=60).output_ids == result.output_ids != base.result(timeout=60).output_ids
    finally:
        cache.close()
