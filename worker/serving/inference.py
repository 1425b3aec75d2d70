"""Inference on this node, the worker's side: a request is resolved to its base and adapter, its prompt tokenized,
and handed to the node's engine process (worker/engine/process.py), which holds the loaded models and their
engines (worker/engine/model_cache.py); cancels asked for through the API reach it from here."""

import contextlib
import dataclasses
import functools
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

from jinja2 import TemplateError

from contract import catalog, events, tool_calls, webhooks
from contract.inference_outputs import response_status
from contract.layout import adapter_dir, checkpoint_dir
from contract.records import now
from contract.settings import Settings
from worker.engine.messages import AdapterRef, ModelKey, Submission
from worker.engine.process import EngineHost
from worker.engine.requests import GenerationDelta, GenerationResult, Priority, RequestFailed, SamplingParams
from worker.models import ModelLoadError, load_tokenizer
from worker.node import metrics
from worker.node.node import Node
from worker.serving.output_stream import OutputStreams, RequestOutput, TextByToken, logprob_entries

CANCEL_POLL_SECONDS = 0.1


_hosts: dict[str, EngineHost] = {}
_hosts_lock = threading.Lock()


def host_for(node: Node) -> EngineHost:
    """The node's engine process (started on first use), whose models the registry reports."""
    with _hosts_lock:
        if node.name not in _hosts:
            _hosts[node.name] = EngineHost(node.backend)
            node.reporters.append(_hosts[node.name].report)
        return _hosts[node.name]


def adapter_of(tenant: str, ref, settings: Settings) -> AdapterRef | None:
    if ref is None:
        return None
    if ref.checkpoint_step is None:
        return AdapterRef(ref.job_id, adapter_dir(settings.artifact_root, tenant, ref.job_id))
    return AdapterRef(f"{ref.job_id}-step-{ref.checkpoint_step}",
                      checkpoint_dir(settings.artifact_root, tenant, ref.job_id, ref.checkpoint_step))


def prompt_ids(tokenizer, request: dict) -> list[int]:
    if "prompt" in request:  # /v1/completions: raw text or token ids, no chat template
        if isinstance(request["prompt"], list):
            return request["prompt"]
        return tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
    messages = [tool_calls.as_template_message(m) if m.get("tool_calls") else m for m in request["messages"]]
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "strict" and v is not None}}
             for t in request.get("tools") or []]
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    except TemplateError as exc:  # templates raise on what they refuse, e.g. roles that do not alternate
        raise RequestFailed("invalid_prompt", f"The model's chat template refused these messages: {exc}") from None


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


def grammar_spec(request: dict) -> dict | None:
    """What the output must match: a forced tool call (tool_choice required or a name), else the response format,
    else under tool_choice auto calls that are well-formed once begun."""
    choice = request.get("tool_choice") or "none"
    if request.get("tools") and choice != "none" and (choice != "auto" or not request.get("response_format")):
        return {"type": "tool_calls", "tools": request["tools"], "choice": choice,
                "parallel": bool(request.get("parallel_tool_calls"))}
    return request.get("response_format")


def sampling_params(request: dict) -> SamplingParams:
    temperature = request.get("temperature")
    return SamplingParams(max_new_tokens=request["max_tokens"], temperature=1.0 if temperature is None else temperature,
                          top_p=request.get("top_p") or 1.0, seed=request.get("seed"),
                          stop=list(request.get("stop") or []), ignore_eos=bool(request.get("ignore_eos")),
                          logit_bias=[(int(t), float(b)) for t, b in request.get("logit_bias") or []],
                          presence_penalty=request.get("presence_penalty") or 0.0,
                          frequency_penalty=request.get("frequency_penalty") or 0.0,
                          logprobs=request.get("logprobs"), grammar=grammar_spec(request))


def base_quantization(request: dict, trained_on: str, settings: Settings) -> str:
    """The bitsandbytes quantization of the base a request runs on: the request's own when it names one; for an
    adapter trained on a quantized base (QLoRA, trained_on "4bit" or "8bit"), that base unless
    settings.qlora_serve_on is "unquantized"; else none (the plain base)."""
    if request.get("quantization") is not None:
        return request["quantization"]
    return trained_on if settings.qlora_serve_on == "quantized" else "none"


def prepare(node: Node, request_id: str, tenant: str, request: dict, priority: Priority) -> Submission:
    """Resolve the model and tokenize the prompt: what the engine process needs (priority: live requests go
    before batch lines in the engine). Raises RequestFailed for an unknown model."""
    try:
        base, ref, job = catalog.resolve_with_job(request["model"], tenant, node.settings, node.store)
    except catalog.UnknownModel as exc:
        raise RequestFailed("model_not_found", str(exc)) from None
    tokenizer = tokenizer_for(base, node.settings)
    ids = prompt_ids(tokenizer, request)
    vocab = len(tokenizer)
    if any(not 0 <= int(t) < vocab for t, _ in request.get("logit_bias") or []):
        raise RequestFailed("invalid_value", f"logit_bias: token ids of '{request['model']}' are 0 to {vocab - 1}.",
                            "logit_bias")
    if any(not 0 <= i < vocab for i in ids):
        raise RequestFailed("invalid_prompt", f"The prompt's token ids must be in [0, {vocab}).")
    model = ModelKey(base, request.get("attn_implementation"),
                     base_quantization(request, (job or {}).get("quantization") or "none", node.settings),
                     bool(request.get("use_kernels")))
    return Submission(request_id, model, adapter_of(tenant, ref, node.settings), ids, sampling_params(request),
                      priority=priority)


def choice_requests(request: dict) -> list[dict]:
    """One engine request per choice: each prompt (a completion may send several) n times, choice i of a prompt
    sampling with seed + i when a seed is given, so choices differ and still repeat."""
    prompts = [{**request, "prompt": p} for p in request["prompts"]] if "prompts" in request else [request]
    n = int(request.get("n") or 1)
    return [{**variant, "seed": None if variant.get("seed") is None else variant["seed"] + i}
            for variant in prompts for i in range(n)]


def start(node: Node, request_id: str, tenant: str, request: dict,
          on_delta: Callable[[int, GenerationDelta], None] | None = None,
          timings: dict[str, float] | None = None) -> list[tuple[str, Future]]:
    """Hand the request's choices to the node's engine process: (engine request id, future) each, in choice order.
    A future's result is a GenerationResult; it raises RequestFailed when the model, adapter or prompt cannot be
    served. With on_delta, the choices stream: on_delta(choice, delta) gets their output as it is produced."""
    choices = choice_requests(request)
    ids = [request_id] if len(choices) == 1 else [f"{request_id}.{i}" for i in range(len(choices))]
    submissions = [prepare(node, i, tenant, c, Priority.LIVE) for i, c in zip(ids, choices)]
    if timings is not None:
        timings["prepared"] = time.time()
    callbacks = None
    if on_delta is not None:
        submissions = [dataclasses.replace(s, stream=True) for s in submissions]
        callbacks = [functools.partial(on_delta, choice) for choice in range(len(submissions))]
    futures = host_for(node).generate_many(submissions, callbacks)
    return list(zip(ids, futures))


def outcome(result: GenerationResult, request: dict, tokenizer) -> dict:
    """The result as the API reports it: tool calls parsed out of the text when the request offered tools (as a
    stream of it finds them: serving/output_stream.py), and logprobs in chat's per-token shape when asked for."""
    # What a request can get wrong is refused before it reaches the engine (prepare, submit): an engine error without
    # a code of its own is the server's (a failed step, an engine closed by eviction), and can be sent again.
    if result.finish_reason == "error":
        raise RequestFailed(result.error_code or "server_error",
                            f"Generation failed on the worker: {result.error or 'unknown error'}")
    out = {"text": result.text, "finish_reason": "stop" if result.finish_reason == "cancelled"
           else result.finish_reason, "prompt_tokens": result.prompt_tokens,
           "completion_tokens": result.completion_tokens, "system_fingerprint": result.served_by}
    if names := tool_calls.callable_tools(request):
        content, calls = tool_calls.parse(result.text, tool_calls.tool_call_format(tokenizer.chat_template), names,
                                          seed=result.request_id)
        if calls:
            out.update(content=content, tool_calls=calls)
            if result.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
    if result.logprobs is not None:
        out["logprobs"] = logprob_entries(tokenizer, result.logprobs)
        if out.get("tool_calls"):  # the Responses message before the calls has the logprobs of its own tokens
            out["content_tokens"] = TextByToken(tokenizer, result.output_ids).tokens_writing(out["content"] or "")
    return out


def merged(results: list[GenerationResult], n: int, request: dict, tokenizer) -> dict:
    """A request's result from its choices' ({text, finish_reason, prompt_tokens, completion_tokens} of the first,
    and `choices` when there are several). The prompt counts once per prompt, not once per choice."""
    outcomes = [outcome(r, request, tokenizer) for r in results]
    result = {**outcomes[0], "prompt_tokens": sum(o["prompt_tokens"] for o in outcomes[::n]),
              "completion_tokens": sum(o["completion_tokens"] for o in outcomes)}
    if len(outcomes) > 1:
        result["choices"] = outcomes
    return result


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
_outputs: dict[str, OutputStreams] = {}


def outputs_for(node: Node) -> OutputStreams:
    with _hosts_lock:
        if node.name not in _outputs:
            _outputs[node.name] = OutputStreams(node.redis)
        return _outputs[node.name]


def cancel_watch_for(node: Node) -> CancelWatch:
    with _hosts_lock:
        if node.name not in _watches:
            _watches[node.name] = CancelWatch(node)
        return _watches[node.name]


def wait(node: Node, started: list[tuple[str, Future]], cancel_key: str) -> list[GenerationResult]:
    """The engine's results; a cancel asked for meanwhile stops the request's choices in the engine."""
    def cancel() -> None:
        for engine_id, _ in started:
            host_for(node).cancel(engine_id)

    with cancel_watch_for(node).watching(cancel_key, cancel):
        return [future.result() for _, future in started]


def run_request(node: Node, kind: str, record_id: str, record: dict | None, current: dict | None,
                stamps: dict[str, float]) -> None:
    """One live request (a response, chat completion or completion) from its record to its result: record, the
    record as the node's intake claimed it (Node.claim_many), None when it was not queued (current: as it was then,
    None when gone); stamps: when the intake pulled and claimed it."""
    store, redis = node.store, node.redis
    if record is None:
        # Ended before it started (a background response cancelled while queued): a stream waiting on it ends too.
        # Not one that another delivery is running: that one ends its stream itself.
        if current is not None and current["request"].get("stream") \
                and current["status"] in ("completed", "failed", "cancelled"):
            outputs_for(node).end(record_id)
        return
    # Wall-clock stamps (the API wrote "received"), so a slow request shows where its time went.
    timings = {**(record.get("timings") or {}), **stamps}
    # A streaming request's output goes to its Redis stream as the engine produces it (serving/output_stream.py).
    outputs = outputs_for(node) if record["request"].get("stream") else None
    on_delta = shaped = None
    if outputs:
        shaped = RequestOutput(record["request"], functools.partial(tokenizer_for, record["base_model"], node.settings))

        def on_delta(choice: int, delta: GenerationDelta) -> None:
            timings.setdefault("first_output", time.time())
            outputs.delta(record_id, choice, delta, shaped)
    try:
        started = start(node, record_id, record["tenant"], record["request"], on_delta, timings)
        timings["submitted"] = time.time()
        results = wait(node, started, record_id)
        timings["generated"] = time.time()
        cancelled = any(r.finish_reason == "cancelled" for r in results)
        fields = {"status": "cancelled" if cancelled else "completed",
                  "result": merged(results, int(record["request"].get("n") or 1), record["request"],
                                   tokenizer_for(record["base_model"], node.settings))}
    except RequestFailed as exc:
        fields = {"status": "failed", "error": {"code": exc.code, "message": str(exc), "param": exc.param}}
    except Exception as exc:  # one bad request must not take the node down
        fields = {"status": "failed", "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}
    if shaped is not None and shaped.first_written is not None:
        timings["first_written"] = shaped.first_written
    fields.update(completed_at=now(), timings=timings)
    metrics.observe(kind, fields["status"], fields.get("result"), timings)
    if store.transition(kind, record_id, ["in_progress"], fields) and record.get("background"):
        # as the response reads: one cut at max_output_tokens ended "incomplete"
        webhooks.job_ended(redis, record_id, response_status(fields["status"], fields.get("result"))[0])
    store.untrack(kind, record_id)
    node.job_finished(record_id)
    if outputs:
        outputs.end(record_id, shaped)
    events.signal_done(redis, record_id)
