"""Inference on this node. Base models stay loaded (a cache bounded by a byte budget), each with a generation
engine that batches every concurrent request for it; fine-tuned adapters are loaded onto the loaded base once
and chosen per request inside a batch, never by reloading the base.

The models and engines live in the node's engine process (worker/serving/engine_host.py): `start` runs in the worker and
hands a request over; `submit` and the ModelCache run in that process."""

import contextlib
import gc
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from contract import catalog, events
from contract.layout import adapter_dir, checkpoint_dir
from contract.records import now
from contract.settings import Settings
from worker.engine.engine import Engine, GenerationRequest, GenerationResult, SamplingParams
from worker.models import ModelLoadError, load_model_and_tokenizer, load_tokenizer
from worker.node import devices, metrics
from worker.node.node import Node

if TYPE_CHECKING:
    from worker.serving.engine_host import EngineHost

CANCEL_POLL_SECONDS = 0.1


class RequestFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class EngineProcessExited(RequestFailed):
    """The node's engine process died while the request ran: nothing about the request failed, so it can be sent
    again (the next one starts a new process)."""

    def __init__(self, exit_code: int | None):
        super().__init__("server_error", f"The worker's engine process exited (exit code {exit_code}) while this "
                                         "request ran; it can be sent again.")


@dataclass
class LoadedModel:
    engine: Engine
    max_positions: int | None
    nbytes: int
    adapters: set[str] = field(default_factory=set)


class ModelCache:
    """Loaded bases keyed by how they were loaded (model, attention, quantization, kernels), least recently used
    evicted first."""

    def __init__(self, settings: Settings, backend: str):
        self.settings = settings
        self.backend = backend
        self._models: OrderedDict[tuple[str, str, str, bool], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict only, never held while loading
        self._loading: dict[tuple[str, str, str, bool], threading.Lock] = {}

    def _cached(self, key) -> LoadedModel | None:
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            return None

    def get(self, base: str, attn_implementation: str, quantization: str, use_kernels: bool) -> LoadedModel:
        key = (base, attn_implementation, quantization, use_kernels)
        if loaded := self._cached(key):
            return loaded
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        # One load per key; requests for models already loaded (and the heartbeat) never wait for it.
        with loading:
            if loaded := self._cached(key):
                return loaded
            try:
                model, tokenizer = load_model_and_tokenizer(base, self.settings, self.backend,
                                                            attn_implementation=attn_implementation,
                                                            quantization=quantization, use_kernels=use_kernels)
            except ModelLoadError as exc:
                raise RequestFailed(exc.code, str(exc)) from None
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            with self._lock:
                while self._models and sum(m.nbytes for m in self._models.values()) + nbytes > \
                        self.settings.model_cache_bytes:
                    self._models.popitem(last=False)[1].engine.close()
            context = getattr(model.config, "max_position_embeddings", None)
            engine = Engine(model, tokenizer, device=devices.torch_device(self.backend),
                            memory_budget_bytes=self.settings.engine_memory_bytes,
                            max_batch_size=self.settings.engine_max_batch_size,
                            max_seq_len=min(self.settings.engine_max_seq_len, context or 1 << 30))
            engine.warmup()  # every batch size's decode graph now, not in the middle of someone's requests
            loaded = LoadedModel(engine, context, nbytes)
            with self._lock:
                self._models[key] = loaded
            freeze_heap()
            return loaded

    @staticmethod
    def attach_adapter(loaded: LoadedModel, name: str, path: Path) -> None:
        """Load an adapter onto the loaded base once; later requests only name it."""
        from peft import PeftModel

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

    def close(self) -> None:
        with self._lock:
            for loaded in self._models.values():
                loaded.engine.close()
            self._models.clear()

    def report(self) -> dict:
        """What the registry shows of this node's loaded models and their engines."""
        with self._lock:
            items = list(self._models.items())
        return {"models": [{"model": base, "attn_implementation": attn, "quantization": quantization,
                            "use_kernels": kernels, "adapters": sorted(m.adapters),
                            "engine": {k: v for k, v in m.engine.stats.items()
                                       if isinstance(v, (int, float, str, type(None)))}}
                           for (base, attn, quantization, kernels), m in items]}


def freeze_heap() -> None:
    """Exempt what is loaded now (torch, transformers, the models' modules) from Python's cyclic collector. A full
    collection walks every object with the GIL held, about 0.25 s in a worker process, and stalls the engine's
    host loop and every request thread meanwhile."""
    gc.collect()
    gc.freeze()


_hosts: dict[str, "EngineHost"] = {}
_hosts_lock = threading.Lock()


def host_for(node: Node) -> "EngineHost":
    """The node's engine process (started on first use), whose models the registry reports."""
    from worker.serving.engine_host import EngineHost

    with _hosts_lock:
        if node.name not in _hosts:
            _hosts[node.name] = EngineHost(node.backend)
            node.reporters.append(_hosts[node.name].report)
        return _hosts[node.name]


def adapter_of(tenant: str, ref, settings: Settings) -> tuple[str, Path] | None:
    if ref is None:
        return None
    if ref.checkpoint_step is None:
        return ref.job_id, adapter_dir(settings.artifact_root, tenant, ref.job_id)
    return (f"{ref.job_id}-step-{ref.checkpoint_step}",
            checkpoint_dir(settings.artifact_root, tenant, ref.job_id, ref.checkpoint_step))


def prompt_ids(tokenizer, request: dict) -> list[int]:
    if "prompt" in request:  # /v1/completions: raw text or token ids, no chat template
        if isinstance(request["prompt"], list):
            return request["prompt"]
        return tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
    return tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


_tokenizers: dict[str, object] = {}
_tokenizers_lock = threading.Lock()


def tokenizer_for(base: str, settings: Settings):
    """The base model's tokenizer, kept in the worker: prompts are tokenized here, so the engine process spends
    its GIL on generation only."""
    with _tokenizers_lock:
        if base not in _tokenizers:
            try:
                _tokenizers[base] = load_tokenizer(base, settings)
            except ModelLoadError as exc:
                raise RequestFailed(exc.code, str(exc)) from None
        return _tokenizers[base]


def prepare(node: Node, request_id: str, tenant: str, request: dict) -> tuple:
    """Resolve the model and tokenize the prompt: what the engine process needs (EngineHost.generate's arguments).
    Raises RequestFailed for an unknown model."""
    try:
        base, ref = catalog.resolve(request["model"], tenant, node.settings, node.store)
    except catalog.UnknownModel as exc:
        raise RequestFailed("model_not_found", str(exc)) from None
    ids = prompt_ids(tokenizer_for(base, node.settings), request)
    return request_id, base, adapter_of(tenant, ref, node.settings), request, ids


def start(node: Node, request_id: str, tenant: str, request: dict) -> Future:
    """Hand the request to the node's engine process. The future's result is a GenerationResult; it raises
    RequestFailed when the model, adapter or prompt cannot be served."""
    return host_for(node).generate(*prepare(node, request_id, tenant, request))


def submit(cache: ModelCache, request_id: str, base: str, adapter: tuple[str, Path] | None, request: dict,
           ids: list[int]) -> tuple[Engine, Future]:
    """In the engine process: load base and adapter as needed, and give the request to the base's engine."""
    loaded = cache.get(base, request.get("attn_implementation") or "sdpa", request.get("quantization") or "none",
                       bool(request.get("use_kernels")))
    if adapter:
        cache.attach_adapter(loaded, *adapter)
    if loaded.max_positions and len(ids) + request["max_tokens"] > loaded.max_positions:
        raise RequestFailed("invalid_prompt", f"The prompt ({len(ids)} tokens) plus max tokens "
                                              f"({request['max_tokens']}) exceeds the model's context of "
                                              f"{loaded.max_positions}.")
    temperature = request.get("temperature")
    params = SamplingParams(max_new_tokens=request["max_tokens"],
                            temperature=1.0 if temperature is None else temperature,
                            top_p=request.get("top_p") or 1.0, seed=request.get("seed"),
                            stop=list(request.get("stop") or []), ignore_eos=bool(request.get("ignore_eos")))
    future = loaded.engine.submit(GenerationRequest(request_id, ids, params, adapter[0] if adapter else None))
    return loaded.engine, future


def outcome(result: GenerationResult) -> dict:
    if result.finish_reason == "error":
        raise RequestFailed("invalid_prompt", result.error or "generation failed")
    return {"text": result.text, "finish_reason": "stop" if result.finish_reason == "cancelled"
            else result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens}


class CancelWatch:
    """Acts on cancels asked for through the API. One thread per node reads the cancel flags of everything running
    on it (live requests, batch chunks) in one round trip each tick, rather than each polling for its own."""

    def __init__(self, node: Node):
        self._redis = node.redis
        # handle -> (cancel key, what stops it); one key may have several (a batch's chunks on this node)
        self._running: dict[object, tuple[str, Callable[[], None]]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="xpujobs-cancel-watch", daemon=True).start()

    @contextlib.contextmanager
    def watching(self, cancel_key: str, on_cancel: Callable[[], None]) -> Iterator[None]:
        """Within the block, a cancel of cancel_key asked for calls on_cancel (once, from the watch's thread)."""
        handle = object()
        with self._changed:
            self._running[handle] = (cancel_key, on_cancel)
            self._changed.notify()
        try:
            yield
        finally:
            self._discard(handle)

    def _discard(self, handle: object) -> None:
        with self._changed:
            self._running.pop(handle, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._running)
                running = list(self._running.items())
            try:
                flags = events.cancels_requested(self._redis, [key for _, (key, _) in running])
            except Exception as exc:  # a Redis blip: try again next tick
                print(f"xpu-jobs cancel watch: {exc}", flush=True)
                flags = []
            for (handle, (_, on_cancel)), cancelled in zip(running, flags):
                if cancelled:
                    self._discard(handle)
                    on_cancel()
            time.sleep(CANCEL_POLL_SECONDS)


_watches: dict[str, CancelWatch] = {}


def cancel_watch_for(node: Node) -> CancelWatch:
    with _hosts_lock:
        if node.name not in _watches:
            _watches[node.name] = CancelWatch(node)
        return _watches[node.name]


def wait(node: Node, future: Future, request_id: str, cancel_key: str) -> GenerationResult:
    """The engine's result; a cancel asked for meanwhile stops the request in the engine."""
    with cancel_watch_for(node).watching(cancel_key, lambda: host_for(node).cancel(request_id)):
        return future.result()


def run_request(node: Node, kind: str, record_id: str) -> None:
    """One live request (a response or a chat completion) from its record to its result."""
    store, redis = node.store, node.redis
    record = store.get(kind, record_id)
    # Attempts count here too: a request that kills its worker (out of memory, say) must not bounce forever.
    if record is None or not node.claim(kind, record_id, {"status": "in_progress", "node": node.name,
                                                          "attempts": int(record.get("attempts") or 0) + 1}):
        return
    # Wall-clock stamps (the API wrote "received"), so a slow request shows where its time went.
    timings = {**(record.get("timings") or {}), "claimed": time.time()}
    try:
        future = start(node, record_id, record["tenant"], record["request"])
        timings["submitted"] = time.time()
        result = wait(node, future, record_id, record_id)
        timings["generated"] = time.time()
        fields = {"status": "cancelled" if result.finish_reason == "cancelled" else "completed",
                  "result": outcome(result)}
    except RequestFailed as exc:
        fields = {"status": "failed", "error": {"code": exc.code, "message": str(exc)}}
    except Exception as exc:  # one bad request must not take the node down
        fields = {"status": "failed", "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}
    fields.update(completed_at=now(), timings=timings)
    metrics.observe(kind, fields["status"], fields.get("result"), timings)
    store.transition(kind, record_id, ["in_progress"], fields)
    store.untrack(kind, record_id)
    node.job_finished(record_id)
    events.signal_done(redis, record_id)
