"""The engine: continuous batching of generation requests over one model on one device.

Why: plain `model.generate` and transformers' continuous batching spend 40-50 ms of host-side Python per decode
step, whatever the batch size, so the device idles. This engine does the per-step work on the device.

Parts (worker/engine/):
  requests.py      what goes in and out: SamplingParams, GenerationRequest, GenerationResult, GenerationDelta, errors
  engine.py        this file: the request queue, the engine thread, the step loop that carries out the schedule
  scheduler.py     which sequences decode, prefill (chunked) or are preempted each step; Sequence
  kv_cache.py      the paged KV cache's block manager
  model_runner.py  the native decoder (Llama-style models) and its prefill/decode forwards
  graphs.py        device-graph capture of the decode step and of packed prefill
  triton_kernels.py  decode attention, fused elementwise kernels and the sampling draw for cuda/xpu
  sampling.py      logits -> tokens (greedy, temperature/top-p with seeded counter-based noise; on cuda/xpu
                   the sampled rows in one fused kernel)
  logits.py        per-request logits processing: logit_bias, penalties, grammar masks, logprobs
  grammar.py       constrained decoding with xgrammar (JSON, JSON schema, forced tool calls)
  detokenizer.py   a sequence's text as its tokens come, a few tokens decoded a time (stop strings, streams)
  fallback.py      any other causal LM through its own forward (a static batch replayed as device graphs where
                   the model allows, else merged dynamic batches)
  device.py        backend helpers
  messages.py, process.py, model_cache.py  the engine process a worker node talks to through a pipe

Native path: the KV cache is paged (kv_cache.py): fixed-size blocks, and a block table per sequence, so a request
holds the cache it has used, not max_seq_len. The scheduler (scheduler.py) admits requests by free blocks, takes a
token budget of prefill per step (long prompts in chunks between decode steps), and preempts the most recent
requests when blocks run out mid-decode (they are recomputed later). Live requests (requests.Priority) are admitted
before waiting batch ones, and running batch sequences are preempted to make room for them. Prefill, with the Triton
kernels and where the device has torch's flash kernel: whole prompts packed end to end (no padding between them),
staged into static buffers and replayed as a device graph captured per row count; else eagerly, right-padded. Each
decode step for a batch bucket is captured once as a CUDA/XPU graph (block tables are static buffers) and then
replayed. The host consumes step k's tokens while the device runs step k+1 (a one-step lag), so the device is kept
busy. If the Triton kernels or graph capture fail on a machine, the engine logs it and falls back
(stats["kernels_error"], stats["graphs_error"]).

Prefix sharing (kv_cache.py): full blocks of a computed prompt are registered by their tokens (and adapter); a later
request starting with the same blocks takes them instead of computing them again (stats["prefix_shared_tokens"]).
It is on where prefill runs right-padded (cpu, devices without torch's flash kernel), where attending to a cached
prefix costs nothing extra; packed prefill (flash, prompts packed end to end, a graph per size) does not read
cached prefixes yet, so it stays off there rather than trade the graph for an eager call.

Memory: by default the cache and the workspace take `memory_fraction` (0.85) of the device memory free when the
engine starts (after the weights; the graphs' temporaries are inside the workspace estimate); on cpu a fixed
CPU_MEMORY_BYTES; `memory_budget_bytes` overrides both. The cache gets what the workspace estimate leaves, at most
enough for every decode row at max_seq_len; a budget whose cache cannot hold one max_seq_len request raises
ValueError. max_seq_len (prompt + completion) defaults to min(max_position_embeddings, 4096); a prompt must be
shorter (else the request fails alone, error_code "context_length_exceeded"), and a completion that reaches it ends
with "length". stats reports the blocks: kv_block_size, kv_blocks_total, kv_blocks_used, kv_blocks_free.

Streaming: a request with `stream=True` submitted with `on_delta` gets a GenerationDelta (the token ids accepted
since the last one, the text they add, their logprobs when asked for) after every engine step that accepted tokens
for it, called from the engine thread (keep it quick), the last one before its result. Deltas' texts concatenate to
the result's text.

Logits processing: a request may carry logit_bias, presence/frequency penalties, a grammar (compiled with
`engine.grammars()`) and logprobs (logits.py, grammar.py); only its own rows are processed, inside `pick`. A step
that holds a constrained request gives up the one-step lag for that step: the grammar's mask needs the token just
drawn, so the tokens in flight are read before the step picks (the forward is already queued on the device).

Thread safety and model swaps: `submit` may be called from any thread; one background thread owns the device
work. Every step runs under `engine.model_lock` (an RLock). To change adapters or swap the model object:

    with engine.model_lock:                       # waits for the current step to finish
        peft_model.load_adapter(path, adapter_name="x")   # or wrap the base: PeftModel.from_pretrained(...)
        engine.update_model(peft_model)            # re-reads weights and adapters, drops captured graphs

`update_model` takes the lock itself, so calling it alone is also safe when the model object was prepared
beforehand. Requests in flight keep their KV cache (the base weights must be the same).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import math
import threading
import time
from typing import Any, Callable

import torch

from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.device import HostTokens, device_module, graphs_available, to_device
from worker.engine.fallback import FallbackPath
from worker.engine.graphs import batch_buckets, length_bucket
from worker.engine.kv_cache import BlockManager
from worker.engine.logits import RequestLogits
from worker.engine.model_runner import (
    PREFILL_PROMPTS,
    NativeModel,
    NativeRunner,
    TorchOps,
    native_unsupported_reason,
    packed_attention,
)
from worker.engine.requests import (
    EngineClosed,
    EngineMemoryError,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    Priority,
)
from worker.engine.sampling import SAMPLE_CHUNK, gumbel_argmax, pick
from worker.engine.scheduler import PrefillPlan, Scheduler, Sequence, WaitingQueue

log = logging.getLogger(__name__)


# The cache's budget on cpu when none is given: the host's memory is not the engine's to size from.
CPU_MEMORY_BYTES = 1 << 30
DEFAULT_MEMORY_FRACTION = 0.85
BLOCK_SIZE = 16  # token positions per cache block


class Engine(NativeRunner):
    """Continuous-batching generation over one model on one device. See the module docstring."""

    def __init__(self, model, tokenizer, *, device: str, memory_budget_bytes: int | None = None,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION, max_batch_size: int = 256,
                 use_graphs: bool | None = None, max_seq_len: int | None = None, prefill_tokens: int | None = None,
                 native: bool | None = None, kernels: str = "auto", block_size: int = BLOCK_SIZE,
                 stream_interval: float = 0.0, static_fallback: bool | None = None):
        self.device = torch.device(device)
        self.backend = self.device.type
        if self.backend not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"device {device!r}: expected cpu, cuda or xpu")
        if self.backend != "cpu" and self.device.index is None:
            self.device = torch.device(self.backend, device_module(self.backend).current_device())
        self.tokenizer = tokenizer
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError("memory_fraction must be in (0, 1]")
        self.budget = int(memory_budget_bytes) if memory_budget_bytes is not None else self._budget_from_device(
            memory_fraction)
        self.block_size = int(block_size)
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.max_batch_size = int(max_batch_size)
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self._want_graphs = use_graphs
        self.use_graphs = graphs_available(self.backend) if use_graphs is None else bool(use_graphs)
        if self.use_graphs and not graphs_available(self.backend):
            raise ValueError(f"use_graphs=True but torch {torch.__version__} has no graphs for {self.backend}")
        self._want_native = native
        # the fallback path's decode over static buffers (fallback.py): None where device graphs are; True on cpu
        # runs the same logic uncaptured (tests); False keeps the dynamic batches
        self.static_fallback = static_fallback
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError("kernels must be 'auto', 'torch' or 'triton'")
        self._want_attention = kernels
        self._tri = None
        self._packed = None
        self._graph_prefill = False
        self._requested_max_seq_len = max_seq_len
        self.prefill_tokens = int(prefill_tokens or (8192 if self.backend != "cpu" else 2048))
        if self.backend == "cuda":
            # Process-wide (torch keeps the attention backends global). cuDNN, torch's first choice on Hopper, builds
            # a plan for every new (batch, length) shape, tens of milliseconds each, and prefill shapes change with
            # every set of prompts; flash attention, chosen next, needs none.
            torch.backends.cuda.enable_cudnn_sdp(False)

        self.model_lock = threading.RLock()
        self._cv = threading.Condition()
        self._waiting = WaitingQueue()
        self._cancel_ids: set[str] = set()
        self._closed = False
        self._by_id: dict[str, list[Sequence]] = {}
        self._streaming: set[Sequence] = set()  # streaming requests with tokens not yet sent in a delta
        # Seconds a streaming request's output is gathered between deltas (its first and last go out at once): one
        # delta per engine step and request costs a message, a Redis entry and a server-sent event each, which
        # under load slows the engine's own process and the API more than the client gains from the finer steps.
        self.stream_interval = float(stream_interval)
        self._grammars = None  # worker/engine/grammar.py's Grammars, built on first use
        self._grammars_lock = threading.Lock()
        self.stats: dict[str, Any] = {
            "decode_steps": 0, "decode_rows": 0, "decode_seconds": 0.0, "prefill_calls": 0,
            "prefill_tokens": 0, "prefill_padded_tokens": 0, "prefill_seconds": 0.0, "graphs_captured": 0,
            "graph_capture_seconds": 0.0, "max_running": 0, "completed": 0, "errors": 0, "busy_seconds": 0.0,
            "peak_memory_bytes": 0, "peak_reserved_bytes": 0, "migrations": 0, "preemptions": 0,
            "preemptions_for_live": 0, "decode_steps_without_adapters": 0,
            "prefill_chunks": 0, "prefix_shared_tokens": 0,
        }
        self._admissions = itertools.count()
        with self.model_lock:
            self._setup(model, first=True)
        self._thread = threading.Thread(target=self._loop, name="xpu-jobs-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ setup

    def _budget_from_device(self, fraction: float) -> int:
        """`fraction` of the device memory free now (the model's weights are loaded: they are not free)."""
        if self.backend == "cpu":
            return CPU_MEMORY_BYTES
        mod = device_module(self.backend)
        try:
            free = mod.mem_get_info(self.device)[0]
        except Exception:  # a runtime without mem_get_info: total minus what torch holds
            free = mod.get_device_properties(self.device).total_memory - mod.memory_reserved(self.device)
        # torch's cached free blocks are free to this engine too
        free += mod.memory_reserved(self.device) - mod.memory_allocated(self.device)
        return int(free * fraction)

    def _setup(self, model, *, first: bool) -> None:
        model.eval()
        param = next(model.parameters())
        if param.device != self.device:
            if first:
                raise ValueError(f"the model is on {param.device}, the engine on {self.device}: move it first")
            raise ValueError(f"update_model: the new model is on {param.device}, the engine on {self.device}")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = base.config
        self.model = model
        self.base = base
        self.is_peft = hasattr(model, "peft_config")
        self.adapters = sorted(model.peft_config.keys()) if self.is_peft else []
        maxpos = getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_seq_len = int(min(self._requested_max_seq_len or min(maxpos, 4096), maxpos))
        gc = getattr(base, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.vocab_size = base.get_output_embeddings().weight.shape[0]

        reason = native_unsupported_reason(model, self.max_seq_len)
        if self._want_native is False:
            reason = "native=False"
        elif self._want_native is True and reason:
            raise ValueError(f"native path requested but unsupported: {reason}")
        path = "native" if reason is None else "hf"
        if reason and self._want_native is not False:
            log.info("engine: using the model's own forward (%s)", reason)

        dtype = param.dtype
        el = torch.empty((), dtype=dtype).element_size()
        hq = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or hq
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        layers = cfg.num_hidden_layers
        self.kv_bytes_per_token = layers * 2 * hkv * head_dim * el
        sig = (path, layers, hkv, head_dim, dtype, self.max_seq_len, cfg.vocab_size)
        reuse = not first and sig == getattr(self, "_sig", None)
        if not first and not reuse:
            # Running requests' caches do not fit the new model: finish them rather than continue wrongly.
            self._fail_running("the model was replaced by an incompatible one while the request ran")
        self._sig = sig
        self.path = path
        self.stats["path"] = path
        self.stats["fallback_reason"] = reason
        self._choose_sampler()

        if path == "native":
            self.nat = NativeModel(model, self.device)
            self._choose_attention()
            if reuse:
                self._graphs = {}
                self._refresh_lora_masks()
            else:
                if hasattr(self, "cache"):
                    del self.cache
                self._allocate_native(dtype, el)
        else:
            self.nat = None
            self._graphs = {}
            if reuse:
                self.fallback.model_changed()
            else:
                self.fallback = FallbackPath(self)

    def _choose_sampler(self) -> None:
        """Sampled rows are drawn by one fused Triton kernel on cuda/xpu (unless kernels='torch'), by torch ops
        on cpu or without triton (the same draw: sampling.gumbel_argmax)."""
        self.draw = gumbel_argmax
        if self.backend != "cpu" and self._want_attention in ("auto", "triton"):
            try:
                from worker.engine import triton_kernels as engine_triton

                self._fused_draw = engine_triton.gumbel_argmax
                self.draw = self._draw_fused
            except Exception as e:  # no triton
                log.info("engine: sampling with torch ops (%s: %s)", type(e).__name__, e)
        self.stats["sampler"] = "torch" if self.draw is gumbel_argmax else "triton"

    def _draw_fused(self, logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The fused kernel's draw; one that raises (a Triton build failing on this device) hands the engine to
        torch ops for good, and stats say so."""
        try:
            return self._fused_draw(logits, temperature, keys)
        except Exception as e:
            log.warning("engine: the fused sampling kernel failed (%s: %s); torch ops from now on",
                        type(e).__name__, e)
            self.draw = gumbel_argmax
            self.stats.update(sampler="torch", sampler_fallback_reason=f"{type(e).__name__}: {e}")
            return gumbel_argmax(logits, temperature, keys)

    def _choose_attention(self) -> None:
        """kernels='triton' (the default on cuda/xpu when triton imports): decode attention that reads each row's
        own length, and fused RMSNorm / q-k norm + RoPE / SiLU*up (triton_kernels.py); else plain torch ops
        (always on cpu, where they reproduce transformers' arithmetic exactly)."""
        want = self._want_attention
        self._tri = None
        if want in ("auto", "triton"):
            why = None
            try:
                from worker.engine import triton_kernels as engine_triton

                if not (engine_triton.supported(self.nat.head_dim, self.nat.hq // self.nat.hkv)
                        and engine_triton.fused_supported(self.nat.head_dim, getattr(self.nat.cfg, "hidden_act", ""))):
                    why = f"head_dim {self.nat.head_dim} is not a power of two >= 16"
                elif self.backend == "cpu" and want == "auto":
                    why = "cpu"
                else:
                    self._tri = engine_triton
            except Exception as e:  # no triton
                why = f"{type(e).__name__}: {e}"
            if want == "triton" and self._tri is None:
                raise ValueError(f"kernels='triton' is unavailable: {why}")
        self.attention = "triton" if self._tri is not None else "torch"
        self._ops = self._tri if self._tri is not None else TorchOps(self.nat.act)
        self.stats["kernels"] = self.attention
        self._packed = None
        if self._tri is not None:
            nat = self.nat
            self._packed, why = packed_attention(self.device, nat.embed.dtype, nat.hq, nat.hkv, nat.head_dim,
                                                 nat.scaling)
            self.stats["packed_prefill"] = why or True
        self._graph_prefill = self._packed is not None and self.use_graphs

    def _workspace_estimate(self, slots: int, el: int) -> int:
        n = self.nat
        wide = max(n.hidden, n.intermediate, (n.hq + 2 * n.hkv) * n.head_dim)
        logits = slots * n.vocab * el
        decode = slots * (16 * wide * el + n.hq * self.max_seq_len * 12) + slots * 64
        if self._tri is None:  # the torch path gathers each row's keys and values, a layer at a time
            decode += 4 * slots * self.max_seq_len * n.hkv * n.head_dim * el
        p = self.prefill_tokens
        prefill = int(1.5 * p * (3 * n.hidden + 3 * (n.hq + 2 * n.hkv) * n.head_dim + n.hq * n.head_dim
                                 + 4 * n.intermediate) * el)
        rows = min(slots, PREFILL_PROMPTS)
        prefill += rows * n.vocab * 12
        sample = SAMPLE_CHUNK * n.vocab * 48
        lora = 0
        if n.lora_rank:
            qkv = (n.hq + 2 * n.hkv) * n.head_dim  # A per part of a fused projection, B block-diagonal
            lora = n.lora_rank * (n.hidden * 6 + n.hq * n.head_dim + n.intermediate + qkv * 3 + n.hidden
                                  + n.intermediate * 4 + n.hidden) * el * n.n_layers
            lora += slots * n.lora_rank * el
        return logits + decode + prefill + sample + lora

    def _allocate_native(self, dtype, el) -> None:
        n, bs = self.nat, self.block_size
        per_block = self.kv_bytes_per_token * bs
        row_blocks = -(-self.max_seq_len // bs)  # blocks of a max_seq_len request
        slots = self.max_batch_size

        def blocks_for(rows: int) -> int:  # what the budget leaves the cache, less the scratch block
            return (self.budget - self._workspace_estimate(rows, el)) // per_block - 1

        while slots > 1 and blocks_for(slots) < row_blocks:  # a small budget: fewer decode rows, smaller workspace
            slots = max(1, slots // 2)
        if blocks_for(slots) < row_blocks:
            raise EngineMemoryError(
                f"memory_budget_bytes={self.budget} cannot hold one request of max_seq_len={self.max_seq_len} "
                f"({row_blocks * per_block} bytes of KV cache) plus the workspace "
                f"({self._workspace_estimate(slots, el)} bytes); raise the budget or lower max_seq_len")
        num_blocks = min(blocks_for(slots), slots * row_blocks)  # more than every row at max_seq_len is unused
        self.num_slots = slots
        dev = self.device
        self._reset_peak()
        self._mem_base = self._allocated()
        self.blocks = BlockManager(num_blocks, bs)
        self.scheduler = Scheduler(self.blocks, self.prefill_tokens, PREFILL_PROMPTS, packed=self._packed is not None)
        scratch = self.blocks.scratch_block
        self.cache = torch.zeros(n.n_layers, 2, num_blocks + 1, bs, n.hkv, n.head_dim, dtype=dtype, device=dev)
        # one row more than decode rows: packed prefill's padding rows use it (their adapter mask is zero)
        self.block_tables = torch.full((slots + 1, row_blocks), scratch, dtype=torch.int32, device=dev)
        self.ids_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.pos_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.next_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.logits_buf = torch.zeros(slots, n.vocab, dtype=dtype, device=dev)
        self.len_ar = torch.arange(row_blocks * bs, device=dev)
        self.cos, self.sin = n.rope_tables(self.max_seq_len, dev)
        self.lora_mask = torch.zeros(slots + 1, max(1, n.lora_rank), dtype=dtype, device=dev)
        # packed prefill's inputs: token ids, positions, decode rows and cache indices per row; the prompts'
        # bounds (cu_seqlens), with room for the padding up to a captured size, cut into pieces no longer than a
        # prompt may be
        self._pf_rows = torch.zeros(4, self.prefill_tokens, dtype=torch.int64, device=dev)
        self._pf_seqs = PREFILL_PROMPTS + -(-self.prefill_tokens // self.max_seq_len)
        self._pf_cu = torch.zeros(self._pf_seqs + 1, dtype=torch.int32, device=dev)
        self._pf_logits = torch.zeros(PREFILL_PROMPTS, n.vocab, dtype=torch.float32, device=dev)
        self._slots: list[Sequence | None] = [None] * slots
        self._free = list(range(slots))
        heapq.heapify(self._free)
        self._inflight: list[HostTokens] = []
        self._graphs: dict[tuple, Any] = {}
        self._graph_pool = device_module(self.backend).graph_pool_handle() if self.use_graphs else None
        self._buckets = batch_buckets(slots)
        self.stats.update(num_slots=slots, max_seq_len=self.max_seq_len, budget_bytes=self.budget,
                          kv_cache_bytes=self.cache.numel() * el, kv_block_size=bs, kv_blocks_total=num_blocks,
                          workspace_estimate_bytes=self._workspace_estimate(slots, el))
        self._block_stats()

    def _block_stats(self) -> None:
        """Gauges of the moment (the counters only grow): cache blocks, requests holding a decode row, waiting."""
        self.stats.update(kv_blocks_used=self.blocks.num_used, kv_blocks_free=self.blocks.num_free,
                          running=sum(s is not None for s in self._slots), waiting=len(self._waiting))

    def _refresh_lora_masks(self) -> None:
        self.lora_mask = torch.zeros(self.num_slots + 1, max(1, self.nat.lora_rank), dtype=self.cache.dtype,
                                     device=self.device)
        for seq in self._slots:
            if seq is None or seq.finished:
                continue
            if seq.req.adapter is not None and seq.req.adapter not in self.nat.adapter_cols:
                self.finish(seq, "error", f"adapter {seq.req.adapter!r} was removed while the request ran")
                continue
            self._set_mask_row(seq)

    def _set_mask_row(self, seq: Sequence) -> None:
        self.lora_mask[seq.slot].zero_()
        if seq.req.adapter is not None:
            c0, c1 = self.nat.adapter_cols[seq.req.adapter]
            self.lora_mask[seq.slot, c0:c1] = 1

    # ------------------------------------------------------------------------------------------ memory

    def _allocated(self) -> int:
        if self.backend == "cpu":
            return 0
        return int(device_module(self.backend).memory_allocated(self.device))

    def _reset_peak(self) -> None:
        if self.backend != "cpu":
            device_module(self.backend).reset_peak_memory_stats(self.device)
            self._reserved_base = int(device_module(self.backend).memory_reserved(self.device))

    def _update_peak(self) -> None:
        if self.backend == "cpu":
            return
        mod = device_module(self.backend)
        self.stats["peak_memory_bytes"] = max(self.stats["peak_memory_bytes"],
                                              int(mod.max_memory_allocated(self.device)) - self._mem_base)
        self.stats["peak_reserved_bytes"] = max(self.stats["peak_reserved_bytes"],
                                                int(mod.max_memory_reserved(self.device)) - self._reserved_base)

    # ------------------------------------------------------------------------------------ public calls

    def submit(self, request: GenerationRequest,
               on_delta: Callable[[GenerationDelta], None] | None = None) -> concurrent.futures.Future:
        """The future of the request's GenerationResult. With request.stream, on_delta gets its new output after
        every step that produced some (from the engine thread: keep it quick), the last delta before the result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        seq = Sequence(request, fut, on_delta)
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._waiting.append(seq)
            self._by_id.setdefault(request.request_id, []).append(seq)
            self._cv.notify()
        return fut

    def generate(self, requests: list[GenerationRequest],
                 on_result: Callable[[GenerationResult], None] | None = None) -> list[GenerationResult]:
        futures = [self.submit(r) for r in requests]
        if on_result is not None:
            for f in concurrent.futures.as_completed(futures):
                on_result(f.result())
        return [f.result() for f in futures]

    def grammars(self):
        """The grammar compiler for this engine's tokenizer (worker/engine/grammar.py's Grammars; built on first
        use: it reads the whole vocabulary)."""
        from worker.engine.grammar import Grammars

        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("constrained decoding needs the engine's tokenizer")
                stops = sorted(self.eos_ids) or [self.tokenizer.eos_token_id]
                self._grammars = Grammars(self.tokenizer, self.vocab_size, stops)
            return self._grammars

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancel_ids.add(request_id)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def update_model(self, model) -> None:
        """Use `model` from the next step on (e.g. the base wrapped in a PeftModel, or after load_adapter /
        delete_adapter on the live PeftModel). Re-reads weights and adapters and drops captured graphs; running
        requests keep their KV cache, so the base weights must be the same. Safe from any thread."""
        with self.model_lock:
            self.sync()
            self._setup(model, first=False)

    def warmup(self, lengths: list[int] | None = None, batch_sizes: list[int] | None = None) -> None:
        """Capture decode graphs ahead of time (where graphs are on), so no request waits for a capture
        (about 0.1 s each for a 0.6B model on an H200). A failure is left to the first real step, which falls back
        (torch ops, then eager) and says why in stats. On the fallback path: its static decode buffers and graphs
        (fallback.py)."""
        if self.path != "native":
            with self.model_lock, torch.no_grad():
                self.fallback.warmup()
            return
        if not self.use_graphs:
            return
        with self.model_lock, torch.no_grad():
            lens = [0] if self._tri is not None else [length_bucket(n, self.max_seq_len)
                                                      for n in (lengths or [self.max_seq_len])]
            try:
                for L in lens:
                    for B in sorted(batch_sizes or self._buckets, reverse=True):
                        self._graph(B, L)
                        if self.nat.lora_rank:  # the same step for a batch without adapter rows
                            self._graph(B, L, lora=False)
                if self._graph_prefill:
                    for size in reversed(self._prefill_sizes()):
                        self._stage_rows([], size)  # all padding: only the scratch block is written
                        self._prefill_graph(size)
            except Exception as e:
                log.warning("engine: graph warm-up failed (%s: %s); capturing on first use", type(e).__name__, e)

    def benchmark_step(self, batch_size: int | None = None, length: int | None = None, iters: int = 20) -> float:
        """Seconds per decode step (graph replay, or the eager forward) for `batch_size` rows whose caches hold
        `length` tokens. The engine must be idle: it writes into cache blocks nobody holds."""
        if self.path != "native":
            raise RuntimeError("benchmark_step needs the native path")
        with self.model_lock, torch.no_grad():
            if self._inflight or any(s is not None for s in self._slots):
                raise RuntimeError("the engine is busy")
            B = self._bucket(min(batch_size or self.num_slots, self.num_slots))
            L = min(length or self.max_seq_len, self.max_seq_len)
            self.pos_buf[:B] = L - 1
            self.ids_buf[:B] = torch.randint(0, self.vocab_size, (B,), device=self.device)
            width = self.block_tables.shape[1]  # every row reads blocks of its own (wrapping round the pool)
            self.block_tables[:B] = (torch.arange(B * width, device=self.device).view(B, width)
                                     % self.blocks.num_blocks).to(torch.int32)
            Lb = 0 if self._tri is not None else (length_bucket(L, self.max_seq_len) if self.use_graphs else L)
            for _ in range(2):
                self._run_decode(B, Lb)
            self.sync()
            t = time.perf_counter()
            for _ in range(iters):
                self._run_decode(B, Lb)
            self.sync()
            self.block_tables.fill_(self.blocks.scratch_block)
            return (time.perf_counter() - t) / iters

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --------------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._has_work():
                    self._cv.wait(timeout=0.5)
                if self._closed:
                    break
            t0 = time.perf_counter()
            with self.model_lock, torch.no_grad():
                try:
                    if self.path == "native":
                        self._iterate_native()
                    else:
                        self.fallback.step()
                except Exception as e:  # never let one bad step kill the engine
                    log.exception("engine step failed")
                    self._fail_running(f"{type(e).__name__}: {e}")
                self._update_peak()
                self._send_deltas()
            self.stats["busy_seconds"] += time.perf_counter() - t0
        with self.model_lock:
            self._fail_running("engine closed")
            with self._cv:
                waiting = self._waiting.clear()
            for seq in waiting:
                self.finish(seq, "error", "engine closed")

    def _has_work(self) -> bool:
        if self._waiting or self._cancel_ids:
            return True
        if self.path == "native":
            return bool(self._inflight) or any(s is not None for s in self._slots)
        return self.fallback.has_work()

    def sync(self) -> None:
        if self.backend != "cpu":
            device_module(self.backend).synchronize(self.device)

    # ------------------------------------------------------------------------------ shared bookkeeping

    def _validate(self, seq: Sequence) -> tuple[str, str] | None:
        """(error code, message) for a request this engine cannot run, else None."""
        err = self._invalid(seq)
        if err is None:
            return None
        if isinstance(err, tuple):
            return err
        return "invalid_prompt", err

    def _invalid(self, seq: Sequence) -> str | tuple[str, str] | None:
        req, p = seq.req, seq.req.params
        ids = req.prompt_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            return "prompt_ids must be a non-empty list of token ids"
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
            return f"prompt_ids must be integers in [0, {self.vocab_size})"
        if len(ids) >= self.max_seq_len:
            return "context_length_exceeded", (
                f"the prompt has {len(ids)} tokens; this engine holds at most {self.max_seq_len} tokens per "
                f"request (prompt + completion), so prompts must be shorter than that")
        if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
            return "max_new_tokens must be an integer >= 1"
        if not (seq.temperature >= 0.0) or math.isinf(seq.temperature):
            return "temperature must be a finite number >= 0"
        if not (0.0 < seq.top_p <= 1.0):
            return "top_p must be in (0, 1]"
        if req.adapter is not None and req.adapter not in self.adapters:
            known = ", ".join(self.adapters) or "none loaded"
            return f"unknown adapter {req.adapter!r} (loaded: {known})"
        if seq.stops and self.tokenizer is None:
            return "stop strings need a tokenizer"
        if any(not 0 <= t < self.vocab_size for t, _ in p.logit_bias or []):
            return f"logit_bias: token ids must be in [0, {self.vocab_size})"
        if p.logprobs is not None and not 0 <= p.logprobs <= self.vocab_size:
            return "logprobs must be >= 0"
        if seq.logits is None:  # a preempted request keeps its own (grammar state, penalties, logprobs so far)
            seq.logits = RequestLogits.of(req, self.vocab_size, self.device,
                                          self.grammars() if req.grammar is not None else None)
        seq.limit = min(p.max_new_tokens, self.max_seq_len - len(ids) + 1)
        if (seq.stops or seq.on_delta is not None) and self.tokenizer is not None and seq.detok is None:
            seq.detok = IncrementalDetokenizer(self.tokenizer)
        return None

    def _result(self, seq: Sequence, reason: str, error: str | None, text: str | None = None,
                code: str | None = None) -> GenerationResult:
        if text is None:
            text = self._decode(seq.out) if reason != "error" else ""
        return GenerationResult(request_id=seq.req.request_id, output_ids=list(seq.out), text=text,
                                finish_reason=reason, prompt_tokens=seq.prompt_len,
                                completion_tokens=len(seq.out), error=error, error_code=code,
                                logprobs=seq.logits.logprobs(len(seq.out)) if seq.logits is not None else None)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def finish(self, seq: Sequence, reason: str, error: str | None = None, text: str | None = None,
               code: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        if self.path == "native":
            self._release(seq)
        with self._cv:
            lst = self._by_id.get(seq.req.request_id)
            if lst is not None:
                if seq in lst:
                    lst.remove(seq)
                if not lst:
                    del self._by_id[seq.req.request_id]
        self.stats["completed"] += 1
        if reason == "error":
            self.stats["errors"] += 1
        try:
            result = self._result(seq, reason, error, text, code)
        except Exception as e:  # a tokenizer failure must still finish the request
            result = GenerationResult(seq.req.request_id, list(seq.out), "", "error", seq.prompt_len,
                                      len(seq.out), f"decoding the output failed: {e}")
        if seq.on_delta is not None:
            self._streaming.discard(seq)
            self._delta(seq, list(seq.out[seq.sent_tokens:]), result.text[seq.sent_text:])
        if not seq.fut.done():
            seq.fut.set_result(result)

    def _send_deltas(self) -> None:
        """Each streaming request's tokens accepted since its last delta, and the text they add, once
        stream_interval has passed since that delta (a request's first tokens go out at once): text that may
        still be the start of a stop string, or an incomplete character, waits for a later delta."""
        now = time.perf_counter()
        due = [seq for seq in self._streaming if seq.sent_tokens == 0 or now - seq.delta_at >= self.stream_interval]
        for seq in due:
            self._streaming.discard(seq)
            text = ""  # (no tokenizer: tokens only)
            if seq.detok is not None:
                seq.detok.update(seq.out)
                text = seq.detok.text
            if seq.stops:
                text = text[:len(text) - max(len(s) for s in seq.stops) + 1]
            self._delta(seq, list(seq.out[seq.sent_tokens:]), text[seq.sent_text:])
            seq.delta_at = now

    def _delta(self, seq: Sequence, tokens: list[int], text: str) -> None:
        if not tokens and not text:
            return
        logprobs = None
        if seq.logits is not None:
            logprobs = seq.logits.logprobs(seq.sent_tokens + len(tokens), start=seq.sent_tokens)
        seq.sent_tokens += len(tokens)
        seq.sent_text += len(text)
        try:
            seq.on_delta(GenerationDelta(seq.req.request_id, tokens, text, logprobs))
        except Exception:  # the consumer's failure must not stop the engine
            log.exception("on_delta failed")

    def accept(self, seq: Sequence, tok: int) -> None:
        """A new token for `seq`; finishes it on EOS, a stop string or its length limit."""
        if seq.finished:
            return
        seq.out.append(tok)
        if seq.on_delta is not None:
            self._streaming.add(seq)
        if seq.logits is not None and not seq.logits.accept(tok):
            self.finish(seq, "error", f"token {tok} is outside the request's grammar")
            return
        if tok in self.eos_ids and not seq.ignore_eos:
            self.finish(seq, "stop")
            return
        if seq.stops:
            searched = len(seq.detok.text)  # held no stop string: one can only end in what this token wrote
            if seq.detok.update(seq.out):
                text = seq.detok.text
                hits = [i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in seq.stops) if i >= 0]
                if hits:
                    self.finish(seq, "stop", text=text[:min(hits)])
                    return
        if len(seq.out) >= seq.limit:
            self.finish(seq, "length")

    def take_cancels(self) -> set[str]:
        with self._cv:
            ids, self._cancel_ids = self._cancel_ids, set()
            if not ids:
                return ids
            cancelled = self._waiting.remove(ids)
        for seq in cancelled:
            self.finish(seq, "cancelled")
        return ids

    def pop_waiting(self, max_n: int) -> list[Sequence]:
        """Up to max_n valid waiting requests, live ones first (invalid ones are finished with an error on the
        way)."""
        got: list[Sequence] = []
        while len(got) < max_n:
            with self._cv:
                seq = self._waiting.popleft()
            if seq is None:
                break
            if seq.finished:  # preempted, then finished by the token it had in flight
                continue
            err = self._validate(seq)
            if err:
                self.finish(seq, "error", err[1], code=err[0])
            else:
                got.append(seq)
        return got

    def push_back(self, seqs: list[Sequence]) -> None:
        """Requests taken from the queue and not run (or preempted) go back ahead of the others of their priority."""
        with self._cv:
            self._waiting.push_front(seqs)

    def _fail_running(self, error: str) -> None:
        if self.path == "native":
            for seq in list(self._slots):
                if seq is not None:
                    self.finish(seq, "error", error)
            for out in self._inflight:
                for _, seq in out.rows:
                    self.finish(seq, "error", error)
            self._inflight = []
        else:
            self.fallback.fail_all(error)

    # ------------------------------------------------------------------------------ native scheduling

    def _iterate_native(self) -> None:
        """One step: blocks for the decoding sequences (preempting if the pool ran dry), room for waiting live
        requests (preempting batch sequences), the decode step launched, the previous step's tokens consumed,
        cancels, then this step's prefill. Preemption comes before the launch, so a victim decodes nothing this step
        and the token it has in flight from the step before is accepted before it can be taken again."""
        run = [s for s in self._slots if s is not None and not s.prefilling and s.n_launched < s.limit]
        if run:
            holders = [s for s in self._slots if s is not None]
            for victim in self.scheduler.reserve_decode(run, holders):
                self._preempt(victim)
        self._make_room_for_live()
        run = [s for s in run if s.slot >= 0]
        new: list[HostTokens] = []
        if run:
            run = self._compact(run)
            self._write_tables([s for s in run if s.cache_len % self.block_size == 0])  # a block added
            new.append(self._launch_decode(run))
        old, self._inflight = self._inflight, new
        self._accept_all(old)
        cancels = self.take_cancels()
        if cancels:
            for seq in list(self._slots):
                if seq is not None and seq.req.request_id in cancels:
                    self.finish(seq, "cancelled")
        self._prefill_step()
        self._block_stats()

    def _make_room_for_live(self) -> None:
        """Preempt running batch sequences for the live requests waiting (scheduler.make_room). Not while a prompt
        is prefilled in chunks: the next prefill steps continue that one, and the live requests come after it. A
        row whose last token is in flight frees before this step's prefill: it counts as free, not as a victim."""
        with self._cv:
            live = [s for s in self._waiting.first(Priority.LIVE, self.scheduler.max_prompts) if not s.finished]
        if not live or any(s is not None and s.prefilling for s in self._slots):
            return
        holders = [s for s in self._slots if s is not None and s.n_launched < s.limit]
        freeing = sum(s is not None for s in self._slots) - len(holders)
        for victim in self.scheduler.make_room(live, holders, len(self._free) + freeing):
            self._preempt(victim)
            self.stats["preemptions_for_live"] += 1

    def _release(self, seq: Sequence) -> None:
        """Give back seq's decode row and cache blocks (its row's block table points at the scratch block again,
        so the rows of later decode steps that it no longer uses write nowhere that matters)."""
        self.blocks.release(seq)
        if seq.slot >= 0 and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
            heapq.heappush(self._free, seq.slot)
            self.block_tables[seq.slot].fill_(self.blocks.scratch_block)
        seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Out of blocks: seq goes back to the front of the queue with what it has, to be recomputed."""
        self._release(seq)
        seq.cache_len = seq.target = 0
        seq.preemptions += 1
        self.stats["preemptions"] += 1
        self.push_back([seq])

    def _write_tables(self, seqs: list[Sequence]) -> None:
        """The device block tables of seqs' decode rows from the host's."""
        if not seqs:
            return
        width = self.block_tables.shape[1]
        rows = torch.full((len(seqs), width), self.blocks.scratch_block, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table = self.blocks.table(seq)
            rows[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        index = to_device([s.slot for s in seqs], torch.int64, self.device)
        if self.backend != "cpu":
            rows = rows.pin_memory()
        self.block_tables.index_copy_(0, index, rows.to(self.device, non_blocking=True))

    def _accept_all(self, outs: list[HostTokens]) -> None:
        for out in outs:
            toks = out.tokens()
            for i, seq in out.rows:
                self.accept(seq, toks[i])

    def _drain(self) -> None:
        """Accept the tokens still on their way to the host now (waits for them)."""
        old, self._inflight = self._inflight, []
        self._accept_all(old)

    def _compact(self, run: list[Sequence]) -> list[Sequence]:
        """Move decoding requests from high rows into free low ones when that shrinks the batch bucket."""
        if not self._free:
            return run
        held = sum(1 for s in self._slots if s is not None)
        top = max(s.slot for s in run) + 1
        if self._bucket(top) <= self._bucket(held):
            return run
        for seq in sorted(run, key=lambda s: -s.slot):
            if not self._free or self._free[0] >= seq.slot:
                break
            dst = heapq.heappop(self._free)
            src = seq.slot
            for buf in (self.ids_buf, self.pos_buf, self.lora_mask, self.block_tables):
                buf[dst] = buf[src]
            self.block_tables[src].fill_(self.blocks.scratch_block)
            self._slots[dst], self._slots[src] = seq, None
            seq.slot = dst
            heapq.heappush(self._free, src)
            self.stats["migrations"] += 1
        return run

    def _bucket(self, n: int) -> int:
        if not self.use_graphs:
            return n
        for b in self._buckets:
            if b >= n:
                return b
        return self._buckets[-1]

    def _launch_decode(self, run: list[Sequence]) -> HostTokens:
        t0 = time.perf_counter()
        B = self._bucket(max(s.slot for s in run) + 1)
        need = max(s.cache_len for s in run) + 1
        if self._tri is not None:
            Lb = 0  # the kernel reads each row's own length: one graph per batch size
        else:
            Lb = length_bucket(need, self.max_seq_len) if self.use_graphs else need
        # a step whose rows all run the base skips the adapters' matmuls (a quarter of a step with 4 adapters)
        lora = bool(self.nat.lora_rank) and any(s.req.adapter is not None for s in run)
        if self.nat.lora_rank and not lora:
            self.stats["decode_steps_without_adapters"] += 1
        self._run_decode(B, Lb, lora)
        rows = [(s.slot, s) for s in run]  # before the drain: a request it finishes gives its row back
        if any(s.logits is not None and s.logits.constrained for s in run):
            self._drain()  # a grammar's next mask needs the tokens of the step before
        toks = pick(self.logits_buf[:B], self.next_buf[:B], rows, [s.n_launched for s in run], self.draw)
        self.ids_buf[:B].copy_(toks)
        self.pos_buf[:B] += 1
        for s in run:
            s.cache_len += 1
            s.n_launched += 1
        out = HostTokens(self.ids_buf[:B], rows, self.backend)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(run)
        self.stats["max_running"] = max(self.stats["max_running"], len(run))
        self.stats["decode_seconds"] += time.perf_counter() - t0
        return out

    def _take_one(self) -> Sequence | None:
        """The next waiting request, its target set and the registered blocks of its prompt's start shared."""
        got = self.pop_waiting(1)
        if not got:
            return None
        seq = got[0]
        seq.target = seq.prompt_len + len(seq.out)
        if self._shares_prefixes:
            shared = self.blocks.match(seq.req.adapter, seq.ids()[:seq.target])
            self.blocks.share(seq, shared)
            seq.cache_len = len(shared) * self.block_size
        return seq

    @property
    def _shares_prefixes(self) -> bool:
        """See the module docstring: packed prefill does not read cached prefixes yet."""
        return self._packed is None

    def _give_back(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.cache_len = 0
        self.push_back([seq])

    def _prefill_step(self) -> None:
        partial = next((s for s in self._slots if s is not None and s.prefilling), None)
        if partial is None:
            with self._cv:
                if not self._waiting:
                    return
        self.scheduler.packed = self._packed is not None
        plan = self.scheduler.plan_prefill(partial, self._take_one, self._give_back, len(self._free))
        admitted = plan.whole + ([plan.chunk[0]] if plan.chunk and plan.chunk[0] is not partial else [])
        if not admitted and plan.chunk is None:
            return
        t0 = time.perf_counter()
        for seq in admitted:
            seq.slot = heapq.heappop(self._free)
            seq.order = next(self._admissions)
            self.stats["prefix_shared_tokens"] += seq.cache_len
            self._slots[seq.slot] = seq
            if self.nat.lora_rank:
                self._set_mask_row(seq)
        try:
            try:
                self._prefill(plan)
            except Exception as e:
                if not self._disable_triton(e):
                    raise
                self._prefill(plan)
        except Exception as e:
            log.exception("prefill failed")
            for seq in plan.whole + ([plan.chunk[0]] if plan.chunk else []):
                self.finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
        self.stats["prefill_seconds"] += time.perf_counter() - t0

    def _prefill(self, plan: PrefillPlan) -> None:
        dev, bs = self.device, self.block_size
        if plan.chunk is not None:
            seq, start, end = plan.chunk
            last = end == seq.target
            blocks = to_device([self.blocks.table(seq)], torch.int64, dev) if start > 0 else None
            logits = self._prefill_forward(to_device([seq.ids()[start:end]], torch.int64, dev),
                                           to_device(self._kv_indices(seq, start, end), torch.int64, dev),
                                           to_device([seq.slot], torch.int64, dev), start,
                                           to_device([end - start - 1], torch.int64, dev) if last else None, blocks)
            seq.cache_len = end
            if self._shares_prefixes:
                self.blocks.register(seq, seq.req.adapter, seq.ids(), end)
            self.stats["prefill_chunks"] += 1
            self._count_prefill(end - start, end - start)
            if last:
                self._start_decoding([seq], logits)
            return
        chunk = plan.whole
        start = chunk[0].cache_len  # the same for all: what a shared prefix already holds
        lens = [s.target - start for s in chunk]
        if self._packed is not None and start == 0:
            logits, padded = self._prefill_packed(chunk)
        else:  # right-padded rows; after a shared prefix, attending to it through the block tables
            n, L = len(chunk), max(lens)
            ids = torch.zeros(n, L, dtype=torch.int64)
            index = torch.empty(n, L, dtype=torch.int64)
            scratch = self.blocks.scratch_block * bs
            for i, s in enumerate(chunk):
                ids[i, :lens[i]] = torch.tensor(s.ids()[start:s.target])
                index[i] = torch.tensor(self._kv_indices(s, start, s.target)
                                        + [scratch + t % bs for t in range(lens[i], L)])
            blocks = None
            if start:
                width = self.blocks.blocks_for(start + L)
                blocks = torch.full((n, width), self.blocks.scratch_block, dtype=torch.int64)
                for i, s in enumerate(chunk):
                    table = self.blocks.table(s)[:width]
                    blocks[i, :len(table)] = torch.tensor(table)
            if self.backend != "cpu":
                ids, index = ids.pin_memory(), index.pin_memory()
                blocks = blocks.pin_memory() if blocks is not None else None
            logits = self._prefill_forward(ids.to(dev, non_blocking=True), index.view(-1).to(dev, non_blocking=True),
                                           to_device([s.slot for s in chunk], torch.int64, dev), start,
                                           to_device([x - 1 for x in lens], torch.int64, dev),
                                           blocks.to(dev, non_blocking=True) if blocks is not None else None)
            padded = n * L
        for s in chunk:
            s.cache_len = s.target
            if self._shares_prefixes:
                self.blocks.register(s, s.req.adapter, s.ids(), s.target)
        self._count_prefill(sum(lens), padded)
        self._start_decoding(chunk, logits)

    def _count_prefill(self, tokens: int, padded: int) -> None:
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += tokens
        self.stats["prefill_padded_tokens"] += padded

    def _start_decoding(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Prefilled sequences become decode rows: their first new token (from the prompt's last logits), their
        position and their block table go into the decode buffers."""
        dev = self.device
        rows = list(enumerate(seqs))
        toks = pick(logits, None, rows, [len(s.out) for s in seqs], self.draw)
        slots = to_device([s.slot for s in seqs], torch.int64, dev)
        self.ids_buf.index_copy_(0, slots, toks)
        self.pos_buf.index_copy_(0, slots, to_device([s.target for s in seqs], torch.int64, dev))
        self._write_tables(seqs)
        for s in seqs:
            s.n_launched = len(s.out) + 1
        self._inflight.append(HostTokens(toks, rows, self.backend))
