"""Per-request model options (attention, quantization, kernels) are part of the model cache's key: a tenant must
not make a worker load a base in unbounded ways, and eviction must not close an engine under running requests.
The real cache, engines and demo model, in this process."""

import pytest

from contract.settings import Settings
from worker.demo_model import build_demo_model
from worker.engine.messages import ModelKey
from worker.engine.model_cache import ModelCache, reclaimable_memory
from worker.engine.requests import RequestFailed


@pytest.fixture
def cache(tmp_path):
    build_demo_model(tmp_path / "models" / "demo-tiny")
    settings = Settings(models_root=tmp_path / "models", artifact_root=tmp_path / "artifacts",
                        base_models=["demo-tiny"], model_variants_per_base=2, engine_max_batch_size=4,
                        engine_max_seq_len=64, engine_memory_bytes=64 * 1024**2)
    cache = ModelCache(settings, "cpu")
    yield cache
    cache.close()


def test_a_base_is_loaded_in_a_bounded_number_of_ways(cache):
    """Was: every distinct (attention, quantization, kernels) loaded one more copy of the base."""
    native, sdpa, eager = (ModelKey("demo-tiny", attn) for attn in (None, "sdpa", "eager"))
    first, second = cache.get(native), cache.get(sdpa)
    cache.started(first), cache.started(second)  # both serving requests
    with pytest.raises(RequestFailed) as refused:
        cache.get(eager)
    assert refused.value.code == "model_capacity" and "at most 2" in str(refused.value)
    assert len(cache.report()) == 2

    cache.finished(first)  # the least recently used is idle now: it makes way, the busy one stays
    cache.get(eager)
    assert sorted(str(m.attn_implementation) for m in cache.report()) == ["eager", "sdpa"]


def test_only_idle_models_count_as_reclaimable(cache):
    """What the engine process reports per device for the heartbeat: an idle model's weights and KV cache (on cpu
    the workspace is allocated per step, so not held), and nothing of a model serving requests."""
    loaded = cache.get(ModelKey("demo-tiny"))
    model = loaded.engine.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    [report] = cache.report()
    assert report.running_requests == 0
    assert report.held_memory == {0: weights + report.engine["kv_cache_bytes"]}
    assert report.engine["kv_cache_bytes"] > 0 and reclaimable_memory([report]) == report.held_memory

    cache.started(loaded)
    [busy] = cache.report()
    assert busy.running_requests == 1 and reclaimable_memory([busy]) == {}
    cache.finished(loaded)
    assert reclaimable_memory(cache.report()) == report.held_memory
