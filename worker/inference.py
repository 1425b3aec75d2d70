"""Single inference requests on this node: base models stay loaded (a cache bounded by a byte budget) and
fine-tuned adapters are loaded onto the loaded base and switched per request, never by reloading the base."""

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from contract import events
from contract.layout import adapter_dir, checkpoint_dir
from contract.records import now
from contract.settings import Settings
from worker.models import ModelLoadError, load_model_and_tokenizer
from worker.node import Node


class RequestFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    nbytes: int
    adapters: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ModelCache:
    """Loaded bases keyed by (model, attention implementation), least recently used evicted first."""

    def __init__(self, settings: Settings, backend: str):
        self.settings = settings
        self.backend = backend
        self._models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, base: str, attn_implementation: str) -> LoadedModel:
        key = (base, attn_implementation)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            try:
                model, tokenizer = load_model_and_tokenizer(base, self.settings, self.backend,
                                                            attn_implementation=attn_implementation)
            except ModelLoadError as exc:
                raise RequestFailed(exc.code, str(exc)) from None
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            while self._models and sum(m.nbytes for m in self._models.values()) + nbytes > \
                    self.settings.model_cache_bytes:
                self._models.popitem(last=False)
            loaded = self._models[key] = LoadedModel(model, tokenizer, nbytes)
            return loaded

    def attach_adapter(self, loaded: LoadedModel, name: str, path) -> None:
        """Load an adapter onto the loaded base once; later requests only switch to it."""
        from peft import PeftModel

        with loaded.lock:
            if name in loaded.adapters:
                return
            if not (path / "adapter_config.json").exists():
                raise RequestFailed("model_not_found", f"The adapter files of '{name}' are missing.")
            if isinstance(loaded.model, PeftModel):
                loaded.model.load_adapter(str(path), adapter_name=name)
            else:
                loaded.model = PeftModel.from_pretrained(loaded.model, str(path), adapter_name=name)
            loaded.model.eval()
            loaded.adapters.add(name)


_caches: dict[int, ModelCache] = {}


def cache_for(node: Node) -> ModelCache:
    return _caches.setdefault(id(node), ModelCache(node.settings, node.backend))


def adapter_for(record: dict, settings: Settings) -> tuple[str, object] | None:
    if not record.get("adapter_job"):
        return None
    job_id, step = record["adapter_job"], record.get("adapter_step")
    if step is None:
        return job_id, adapter_dir(settings.artifact_root, record["tenant"], job_id)
    return f"{job_id}-step-{step}", checkpoint_dir(settings.artifact_root, record["tenant"], job_id, step)


def generate(loaded: LoadedModel, adapter: str | None, request: dict) -> dict:
    import torch

    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit and len(prompt_ids) + request["max_tokens"] > limit:
        raise RequestFailed("invalid_prompt", f"The prompt ({len(prompt_ids)} tokens) plus max tokens "
                                              f"({request['max_tokens']}) exceeds the model's context of {limit}.")
    temperature = request.get("temperature")
    sample = temperature is not None and temperature > 0
    options = {"max_new_tokens": request["max_tokens"], "do_sample": sample,
               "pad_token_id": tokenizer.pad_token_id}
    if sample:
        options.update(temperature=temperature, top_p=request.get("top_p") or 1.0)
    if request.get("stop"):
        options.update(stop_strings=request["stop"], tokenizer=tokenizer)
    with loaded.lock, torch.inference_mode():
        if request.get("seed") is not None:
            torch.manual_seed(request["seed"])
        model = loaded.model
        ids = torch.tensor([prompt_ids], device=model.device)
        if adapter:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
        elif hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
        else:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
    new = out[0][len(prompt_ids):].tolist()
    finished = bool(new) and new[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(new, skip_special_tokens=True)
    for stop in request.get("stop") or []:
        if stop in text:
            text, finished = text[: text.index(stop)], True
    return {"text": text, "finish_reason": "stop" if finished or len(new) < request["max_tokens"] else "length",
            "prompt_tokens": len(prompt_ids), "completion_tokens": len(new)}


def run_request(node: Node, kind: str, record_id: str) -> None:
    store, redis = node.store, node.redis
    record = store.get(kind, record_id)
    if record is None or not store.transition(kind, record_id, ["queued"], {"status": "in_progress",
                                                                             "node": node.name}):
        return
    node.job_started(record_id)
    try:
        cache = cache_for(node)
        loaded = cache.get(record["base_model"], record["request"].get("attn_implementation") or "sdpa")
        adapter = adapter_for(record, node.settings)
        if adapter:
            cache.attach_adapter(loaded, *adapter)
        result = generate(loaded, adapter[0] if adapter else None, record["request"])
        cancelled = events.cancel_requested(redis, record_id)
        store.transition(kind, record_id, ["in_progress"], {
            "status": "cancelled" if cancelled else "completed", "result": result, "completed_at": now()})
    except RequestFailed as exc:
        store.transition(kind, record_id, ["in_progress"], {
            "status": "failed", "error": {"code": exc.code, "message": str(exc)}, "completed_at": now()})
    except Exception as exc:  # one bad request must not take the node down
        store.transition(kind, record_id, ["in_progress"], {
            "status": "failed", "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"},
            "completed_at": now()})
    finally:
        store.untrack(kind, record_id)
        node.job_finished(record_id)
        redis.rpush(events.done_key(record_id), "1")
        redis.expire(events.done_key(record_id), 3600)
