"""The engine process's loaded models: base models stay loaded (a cache bounded by a byte budget), each with a
generation engine that batches every concurrent request for it; fine-tuned adapters are loaded onto the loaded
base once and chosen per request inside a batch, never by reloading the base.

Several models on one device share it: each new engine sizes its KV cache from the memory free when it starts
(XPUJOBS_ENGINE_MEMORY_FRACTION of it), so a later model gets what the earlier ones left. When that is too little
for one request (or the weights do not fit), an idle model (no request running) is evicted, least recently used
first, and the load tried again; when every loaded model is serving requests, the load is refused (model_capacity,
retryable). An engine with requests is never closed under them. A fine-tune about to start on the node has every
idle model evicted first (release_idle)."""

import gc
import itertools
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from contract.settings import Settings
from worker.engine.engine import Engine
from worker.engine.messages import AdapterRef, ModelKey, ModelReport, Submission
from worker.engine.requests import EngineClosed, EngineMemoryError, GenerationDelta, GenerationRequest, RequestFailed
from worker.models import ModelLoadError, load_model_and_tokenizer
from worker.node import devices


def build_engine(model, tokenizer, settings: Settings, device: str, native: bool | None = None) -> Engine:
    """The engine a worker runs for a loaded model, from the settings (bench/ builds the same one), its graphs
    captured now rather than in the middle of someone's requests. native=False: the model's own forward."""
    context = getattr(model.config, "max_position_embeddings", None)
    engine = Engine(model, tokenizer, device=device, memory_budget_bytes=settings.engine_memory_bytes,
                    memory_fraction=settings.engine_memory_fraction, max_batch_size=settings.engine_max_batch_size,
                    max_seq_len=min(settings.engine_max_seq_len, context or 1 << 30), native=native,
                    stream_interval=settings.engine_stream_interval_ms / 1e3)
    engine.warmup()
    return engine


class _NoRoom(Exception):
    """The device (or the cache's byte bound) has no room for a model until another is evicted."""


@dataclass
class LoadedModel:
    engine: Engine
    max_positions: int | None
    nbytes: int
    weight_bytes: dict[int, int]  # device index -> bytes of the weights there, adapters included
    adapters: set[str] = field(default_factory=set)
    running: int = 0  # requests submitted and not finished: a model serving them is never evicted


class ModelCache:
    """Loaded bases keyed by how they were loaded (model, attention, quantization, kernels), least recently used
    evicted first, and only while idle: per-request options cannot make a worker load a base in unbounded ways
    (settings.model_variants_per_base), nor evict an engine under running requests. A load that finds no room
    among idle models is refused (model_capacity, retryable)."""

    def __init__(self, settings: Settings, backend: str):
        self.settings = settings
        self.backend = backend
        self._models: OrderedDict[ModelKey, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict only, never held while loading
        self._loading: dict[ModelKey, threading.Lock] = {}

    def _cached(self, key) -> LoadedModel | None:
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            return None

    def get(self, key: ModelKey) -> LoadedModel:
        if loaded := self._cached(key):
            return loaded
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        # One load per key; requests for models already loaded (and the heartbeat) never wait for it.
        with loading:
            if loaded := self._cached(key):
                return loaded
            self._make_room(key, 0)  # the variant bound before loading anything
            loaded = self._with_room(lambda: self._load(key))
            with self._lock:
                self._models[key] = loaded
            freeze_heap()
            return loaded

    def _make_room(self, key: ModelKey, nbytes: int) -> None:
        """Evict idle models, least recently used first, until `key` (of nbytes) fits the variant bound and the
        byte budget; raises RequestFailed when only models serving requests stand in the way."""
        limit = self.settings.model_variants_per_base
        with self._lock:
            while True:
                variants = [k for k in self._models if k.base == key.base]
                over_variants = len(variants) >= limit
                over_bytes = sum(m.nbytes for m in self._models.values()) + nbytes > self.settings.model_cache_bytes
                if not over_variants and not (over_bytes and self._models):
                    return
                candidates = variants if over_variants else list(self._models)
                idle = [k for k in candidates if self._models[k].running == 0]
                if not idle:
                    why = (f"'{key.base}' is loaded on this worker in {len(variants)} ways already (attention, "
                           f"quantization, kernels; at most {limit} at once), each serving requests"
                           if over_variants else "the worker's model memory is taken by models serving requests")
                    raise RequestFailed("model_capacity", f"Cannot load '{key.base}' this way now: {why}. Retry "
                                                          "later, or leave out the per-request model options.")
                self._models.pop(idle[0]).engine.close()

    def _load(self, key: ModelKey) -> LoadedModel:
        """Weights and engine; _NoRoom when the device has too little memory for them."""
        import torch

        try:
            model, tokenizer = load_model_and_tokenizer(key.base, self.settings, self.backend,
                                                        attn_implementation=key.attn_implementation or "sdpa",
                                                        quantization=key.quantization, use_kernels=key.use_kernels)
        except torch.OutOfMemoryError as exc:
            _free_memory(self.backend)
            raise _NoRoom(f"its weights do not fit: {exc}") from None
        except ModelLoadError as exc:
            raise RequestFailed(exc.code, str(exc)) from None
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            self._make_room(key, nbytes)
            engine = build_engine(model, tokenizer, self.settings, devices.torch_device(self.backend),
                                  native=False if key.wants_hf_path else None)
        except (EngineMemoryError, torch.OutOfMemoryError) as exc:  # the budget cannot hold one request
            del model
            _free_memory(self.backend)
            raise _NoRoom(str(exc)) from None
        except BaseException:
            del model
            _free_memory(self.backend)
            raise
        return LoadedModel(engine, getattr(model.config, "max_position_embeddings", None), nbytes,
                           weight_bytes_by_device(model, self.backend))

    def _with_room(self, load: Callable[[], LoadedModel]) -> LoadedModel:
        """load(), evicting idle models (least recently used first) while the device has no room for it; refused
        (model_capacity, retryable) when only models serving requests stand in the way."""
        while True:
            try:
                return load()
            except _NoRoom as exc:
                why = str(exc)
            if self._evict_idle() is None:
                raise RequestFailed("model_capacity", f"The model cannot be loaded on this worker now: {why}; "
                                                      "the models loaded are serving requests. Retry later.")

    def _evict_idle(self) -> ModelKey | None:
        """Close the least recently used model serving no request; None when every one is busy."""
        with self._lock:
            key = next((k for k, m in self._models.items() if m.running == 0), None)
            if key is None:
                return None
            loaded = self._models.pop(key)
        loaded.engine.close()
        _free_memory(self.backend)
        return key

    def release_idle(self) -> list[str]:
        """Evict every idle model (a fine-tune is about to need the device); the bases evicted."""
        evicted = []
        while (key := self._evict_idle()) is not None:
            evicted.append(key.base)
        return evicted

    @staticmethod
    def attach_adapter(loaded: LoadedModel, adapter: AdapterRef) -> None:
        """Load an adapter onto the loaded base once; later requests only name it."""
        from peft import PeftModel

        name, path = adapter.name, adapter.path
        engine = loaded.engine
        with engine.model_lock:  # waits for the engine's current step
            if name in loaded.adapters:
                return
            if not (path / "adapter_config.json").exists():
                raise RequestFailed("model_not_found", f"The adapter files of '{name}' are missing.")
            model = engine.model
            if isinstance(model, PeftModel):
                model.load_adapter(str(path), adapter_name=name)
            else:
                model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
            model.eval()
            engine.update_model(model)
            engine.warmup()  # update_model dropped the captured graphs
            loaded.adapters.add(name)
            loaded.weight_bytes = weight_bytes_by_device(model, engine.backend)

    def started(self, loaded: LoadedModel) -> None:
        with self._lock:
            loaded.running += 1

    def finished(self, loaded: LoadedModel) -> None:
        with self._lock:
            loaded.running -= 1

    def close(self) -> None:
        with self._lock:
            for loaded in self._models.values():
                loaded.engine.close()
            self._models.clear()

    def report(self) -> list[ModelReport]:
        """What the registry shows of this node's loaded models and their engines."""
        with self._lock:
            items = [(key, m, m.running) for key, m in self._models.items()]
        return [ModelReport(key.base, key.attn_implementation, key.quantization, key.use_kernels,
                            sorted(m.adapters), {k: v for k, v in m.engine.stats.items()
                                                 if isinstance(v, (int, float, str, type(None)))},
                            running, self._held_memory(m))
                for key, m, running in items]

    def _held_memory(self, loaded: LoadedModel) -> dict[int, int]:
        """Device index -> bytes that evicting the model gives back: its weights, its engine's KV cache and, on a
        device, the workspace the engine sized itself for (torch's allocator and the captured graphs keep it
        between steps). On the host the workspace is allocated per step and returned after it, so it is in the
        host's available memory already and not counted again."""
        held = dict(loaded.weight_bytes)
        stats = loaded.engine.stats
        engine_bytes = stats.get("kv_cache_bytes", 0)
        if self.backend != "cpu":
            engine_bytes += stats.get("workspace_estimate_bytes", 0)
        index = loaded.engine.device.index or 0
        held[index] = held.get(index, 0) + engine_bytes
        return held


def reclaimable_memory(models: list[ModelReport]) -> dict[int, int]:
    """Device index -> bytes evicting the idle models would give back now; a model serving requests is never
    evicted, so it counts nothing."""
    total: dict[int, int] = {}
    for model in models:
        if model.running_requests == 0:
            for index, nbytes in model.held_memory.items():
                total[index] = total.get(index, 0) + nbytes
    return total


def weight_bytes_by_device(model, backend: str) -> dict[int, int]:
    """Device index (0: the host on cpu) -> bytes of the model's parameters and buffers there. On a device backend
    whatever sits on the host (offloaded layers) is left out: evicting it frees no device memory."""
    held: dict[int, int] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type == backend:
            index = tensor.device.index or 0
            held[index] = held.get(index, 0) + tensor.numel() * tensor.element_size()
    return held


def freeze_heap() -> None:
    """Exempt what is loaded now (torch, transformers, the models' modules) from Python's cyclic collector. A full
    collection walks every object with the GIL held, about 0.25 s in a worker process, and stalls the engine's
    host loop and every request thread meanwhile."""
    gc.collect()
    gc.freeze()


def _free_memory(backend: str) -> None:
    """Give what closed engines and dropped models held back to the device."""
    gc.collect()
    if backend != "cpu":
        import torch

        getattr(torch, backend).empty_cache()


def submit(cache: ModelCache, submission: Submission,
           on_delta: Callable[[GenerationDelta], None] | None = None) -> tuple[Engine, Future]:
    """Load base and adapter as needed, and give the request to the base's engine."""
    ids, params = submission.prompt_ids, submission.params
    request = GenerationRequest(submission.request_id, ids, params,
                                submission.adapter.name if submission.adapter else None, stream=submission.stream,
                                priority=submission.priority)

    def hand_over(loaded: LoadedModel) -> Future:
        if submission.adapter:
            cache.attach_adapter(loaded, submission.adapter)
        if loaded.max_positions and len(ids) + params.max_new_tokens > loaded.max_positions:
            raise RequestFailed("context_length_exceeded",
                                f"The prompt ({len(ids)} tokens) plus max tokens ({params.max_new_tokens}) exceeds "
                                f"the model's context of {loaded.max_positions}.")
        if len(ids) >= loaded.engine.max_seq_len:  # the engine would refuse it too, but as an error of its own
            raise RequestFailed("invalid_prompt", f"The prompt ({len(ids)} tokens) must be shorter than the "
                                                  f"{loaded.engine.max_seq_len} tokens this worker holds per request.")
        if params.grammar is not None:  # compiled here, on the request's thread, never on the engine's
            from worker.engine.grammar import GrammarError

            try:
                request.grammar = loaded.engine.grammars().compile(params.grammar)
            except GrammarError as exc:
                raise RequestFailed("invalid_value", str(exc), exc.param) from None
        return loaded.engine.submit(request, on_delta)

    # Counted as running before its adapter is attached, so no eviction closes the engine meanwhile.
    loaded = cache.get(submission.model)
    cache.started(loaded)
    try:
        try:
            future = hand_over(loaded)
        except EngineClosed:  # evicted between the lookup and started(): loaded again, the adapter with it
            cache.finished(loaded)
            loaded = cache.get(submission.model)
            cache.started(loaded)
            future = hand_over(loaded)
    except BaseException:
        cache.finished(loaded)
        raise
    future.add_done_callback(lambda _: cache.finished(loaded))
    fingerprint = served_by(submission.model, loaded.engine)
    # Runs before the caller's own callbacks (added later), so every result leaves with it.
    future.add_done_callback(lambda done: done.exception() or setattr(done.result(), "served_by", fingerprint))
    return loaded.engine, future


def served_by(key: ModelKey, engine: Engine) -> str:
    """The path and kernels that serve a model, as responses name them in system_fingerprint: the native path
    with its own kernels (Triton or torch ops, device graphs or not), or the model's own forward with the
    attention, Hub kernels and bitsandbytes quantization it was loaded with."""
    if engine.path == "native":
        return f"xpu-jobs-native-{engine.attention}{'-graphs' if engine.use_graphs else ''}"
    return (f"xpu-jobs-hf-{key.attn_implementation or 'sdpa'}{'-hub-kernels' if key.use_kernels else ''}"
            f"{'' if key.quantization == 'none' else '-bnb-' + key.quantization}")
