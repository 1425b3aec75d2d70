"""The worker's generation engine: continuous batching over a preallocated KV cache, with the decode step
captured in device graphs where the backend has them.

Why: plain `model.generate` and transformers' continuous batching spend 40-50 ms of host-side Python per decode
step, whatever the batch size, so the device idles. This engine does the per-step work on the device:

* Native path (Llama-style decoders: llama, mistral, qwen2, qwen3). A forward written here against the model's own
  weight tensors; the KV cache is one preallocated tensor, sized from a memory budget, with one slot per running
  request. Prefill, with the Triton kernels and where the device has torch's flash kernel: prompts packed end to end
  (no padding between them), staged into static buffers and replayed as a device graph captured per row count; else
  eagerly in right-padded chunks (causal attention, so padding never leaks into real tokens). Each decode step for a
  batch bucket x length bucket is captured once as a CUDA/XPU graph and then replayed, so a step costs a handful of
  host calls. The host consumes step k's tokens while the device runs step k+1 (a one-step lag), so the device is
  kept busy. LoRA adapters (PEFT) are applied per request inside the same batch: every adapter's A and B matrices
  are stacked per projection and a per-slot mask selects the adapter's rank columns, i.e.
  delta = ((x @ A_all^T) * mask) @ (scaling * B_all)^T.
  On cuda/xpu with triton installed (kernels="auto"/"triton"), worker/engine/triton_kernels.py supplies a decode
  attention kernel that reads only each row's own cache length (so one graph per batch size suffices) and fused
  RMSNorm / q-k norm + RoPE / SiLU*up kernels; on cpu (and with kernels="torch") plain torch ops that reproduce
  transformers' arithmetic exactly. If the Triton kernels or graph capture fail on a machine, the engine logs it
  and falls back (stats["kernels_error"], stats["graphs_error"]).
* Fallback path (any other causal LM, or adapters the native path does not understand, e.g. DoRA): the model's
  own forward with a DynamicCache, requests batched in "cohorts" that join between steps; PEFT's mixed-batch
  `adapter_names=[...]` selects adapters per row. Correct, but host-bound like `generate`.

Memory: the KV cache ((num_slots + 1 spare for prefill's padding) x max_seq_len tokens) plus an estimate of the
workspace (logits, prefill and decode activations, sampling temporaries, stacked LoRA) is fitted into
memory_budget_bytes at construction: num_slots = min(max_batch_size, what fits); a budget that cannot hold one
max_seq_len request raises ValueError. Nothing grows afterwards except transient activations, which the estimate
covers (the benchmark reports the measured peak: stats["peak_memory_bytes"]). max_seq_len (prompt + completion)
defaults to min(max_position_embeddings, 4096); prompts must be shorter, and a completion that reaches it ends with
"length".

Sampling is per request: temperature 0 is greedy (argmax, the same tokens as `generate(do_sample=False)`);
otherwise temperature + top_p, drawn with counter-based noise from (seed, token index, vocabulary index), so a
seed reproduces the same tokens whatever else shares the batch.

Thread safety and model swaps: `submit` may be called from any thread; one background thread owns the device
work. Every step runs under `engine.model_lock` (an RLock). To change adapters or swap the model object:

    with engine.model_lock:                       # waits for the current step to finish
        peft_model.load_adapter(path, adapter_name="x")   # or wrap the base: PeftModel.from_pretrained(...)
        engine.update_model(peft_model)            # re-reads weights and adapters, drops captured graphs

`update_model` takes the lock itself, so calling it alone is also safe when the model object was prepared
beforehand; the lock matters when you mutate the model the engine is currently using (load_adapter /
delete_adapter on the live PeftModel). Requests in flight keep their KV cache (the base weights must be the same).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_SAMPLE_CHUNK = 16  # rows sampled at once: bounds the [rows, vocab] temporaries of top-p and the noise
_PREFILL_PROMPTS = 64  # prompts per prefill call at most: bounds its [prompts, vocab] logits


# ----------------------------------------------------------------------------------------------- interface


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past EOS until max_new_tokens (benchmarks)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    output_ids: list[int]  # generated tokens; includes the EOS token when one ended the request
    text: str  # decoded without special tokens, cut before a matched stop string
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class EngineClosed(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ helpers

_M32 = 0xFFFFFFFF


def _mix32_py(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_key(seed: int, step: int) -> int:
    return _mix32_py((seed & _M32) ^ _mix32_py(((seed >> 32) & _M32) ^ _mix32_py(step ^ 0x9E3779B9)))


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], seeds: list[int],
                  steps: list[int]) -> torch.Tensor:
    """One token per row of float32 `logits` [R, V]: softmax(logits / T), top-p filtered, drawn with the
    exponential race argmax(p / E), E = -log(u) and u a hash of (seed, step, vocabulary index)."""
    out = []
    dev = logits.device
    vocab = torch.arange(logits.shape[-1], device=dev, dtype=torch.int64)
    for i in range(0, logits.shape[0], _SAMPLE_CHUNK):
        sl = slice(i, i + _SAMPLE_CHUNK)
        t = _to_device(temperature[sl], torch.float32, dev)[:, None]
        probs = torch.softmax(logits[sl].float() / t, dim=-1)
        tp = top_p[sl]
        if any(p < 1.0 for p in tp):
            sp, idx = probs.sort(dim=-1, descending=True)
            before = sp.cumsum(dim=-1) - sp  # mass of the more likely tokens
            cut = before >= _to_device(tp, torch.float32, dev)[:, None]
            probs = torch.zeros_like(probs).scatter_(-1, idx, sp.masked_fill(cut, 0.0))
        keys = _to_device([_row_key(s, k) for s, k in zip(seeds[sl], steps[sl], strict=True)], torch.int64, dev)
        h = _mix32(keys[:, None] ^ vocab[None, :])
        u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        out.append(torch.argmax(probs / (-torch.log(u)), dim=-1))
    return torch.cat(out)


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a pageable copy (which would wait for all queued device work)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    try:
        t = t.pin_memory()
    except Exception:
        pass
    return t.to(device, non_blocking=True)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly transformers' LlamaRMSNorm / Qwen3RMSNorm.
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _device_module(backend: str):
    return getattr(torch, backend, None)


def _graphs_available(backend: str) -> bool:
    mod = _device_module(backend)
    if backend == "cuda":
        return mod is not None and hasattr(mod, "CUDAGraph")
    if backend == "xpu":
        return mod is not None and hasattr(mod, "XPUGraph") and hasattr(mod, "graph")
    return False


def batch_buckets(slots: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 129, 16)) + list(range(160, slots + 32, 32))
    return sorted({min(s, slots) for s in sizes if s < slots} | {slots})


def length_bucket(n: int, max_len: int) -> int:
    step = 128 if n <= 1024 else 512 if n <= 4096 else 2048
    return min(max_len, -(-n // step) * step)


def packed_attention(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, head_dim: int,
                     scale: float) -> tuple[Callable | None, str | None]:
    """Causal attention over prompts packed end to end, so a prefill computes only real tokens, not padding.
    Returns (attend(q, k, v, cu_seqlens, max_len), None) where a probe on this device works, else (None, why).
    It calls the flash kernel under torch.nn.attention.varlen.varlen_attn directly: that wrapper costs about
    150 us of host time per call on an H200 host (28 calls per prefill), and prefill is bound by host time. The
    kernel takes grouped-query k and v as they are."""
    flash = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if flash is None:
        return None, f"torch {torch.__version__} has no flash attention op"

    def attend(q, k, v, cu, max_len):
        return flash(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0]

    try:  # prompts of 3, 1 and 0 tokens (unused entries are empty): the first must not see the second
        q = torch.randn(4, hq, head_dim, dtype=dtype, device=device)
        k = torch.randn(4, hkv, head_dim, dtype=dtype, device=device)
        v = torch.randn(4, hkv, head_dim, dtype=dtype, device=device)
        got = attend(q, k, v, torch.tensor([0, 3, 4, 4], dtype=torch.int32, device=device), 3)
        want = F.scaled_dot_product_attention(q[:3].transpose(0, 1), k[:3].transpose(0, 1), v[:3].transpose(0, 1),
                                              is_causal=True, scale=scale, enable_gqa=hq != hkv).transpose(0, 1)
        if not torch.allclose(got[:3].float(), want.float(), atol=2e-2, rtol=2e-2):
            return None, "the flash kernel disagrees with scaled_dot_product_attention here"
    except Exception as e:  # no flash kernel for this device or dtype
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return attend, None


# -------------------------------------------------------------------------------------- per-request state


class _Seq:
    __slots__ = ("req", "fut", "prompt_len", "limit", "out", "n_launched", "cache_len", "slot", "finished",
                 "temperature", "top_p", "seed", "stops", "ignore_eos", "adapter_col", "cancelled", "t_submit")

    def __init__(self, req: GenerationRequest, fut: concurrent.futures.Future):
        self.req = req
        self.fut = fut
        self.prompt_len = len(req.prompt_ids)
        self.limit = 0
        self.out: list[int] = []
        self.n_launched = 0
        self.cache_len = 0
        self.slot = -1
        self.finished = False
        self.cancelled = False
        p = req.params
        self.temperature = float(p.temperature)
        self.top_p = float(p.top_p)
        self.seed = p.seed if p.seed is not None else random.getrandbits(63)
        self.stops = [s for s in (p.stop or []) if s]
        self.ignore_eos = bool(getattr(p, "ignore_eos", False))
        self.adapter_col = -1
        self.t_submit = time.perf_counter()


class _Out:
    """Tokens on their way to the host: one tensor, copied without blocking, read one step later."""

    def __init__(self, tokens: torch.Tensor, rows: list[tuple[int, _Seq]], backend: str):
        self.rows = rows  # (index into tokens, seq)
        self.event = None
        if backend == "cpu":
            self.host = tokens.clone()
            return
        try:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = _device_module(backend).Event()
            self.event.record()
        except Exception:  # no pinned memory: a blocking copy
            self.host = tokens.to("cpu")
            self.event = None

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


# ----------------------------------------------------------------------------------- native architecture


class _Layer:
    __slots__ = ("ln1", "ln2", "q_norm", "k_norm", "lin")


class _NativeModel:
    """Weight views (not copies) of a Llama-style decoder, plus stacked LoRA matrices for per-row adapters."""

    def __init__(self, model, device: torch.device):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = base.config
        core = base.model
        self.cfg = cfg
        self.dtype = core.embed_tokens.weight.dtype
        self.n_layers = cfg.num_hidden_layers
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.hidden = cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.vocab = base.lm_head.weight.shape[0]
        self.eps = core.norm.variance_epsilon
        self.embed = core.embed_tokens.weight
        self.norm = core.norm.weight
        self.lm_head = base.lm_head.weight
        self.lm_bias = getattr(base.lm_head, "bias", None)
        self.rotary = core.rotary_emb
        self.act = core.layers[0].mlp.act_fn
        self.scaling = getattr(core.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.adapters: list[str] = []
        self.adapter_cols: dict[str, tuple[int, int]] = {}
        self.lora_rank = 0
        lora_modules = {}
        if hasattr(model, "peft_config"):
            self.adapters = sorted(model.peft_config.keys())
            ranks = {a: 0 for a in self.adapters}
            for name, mod in base.named_modules():
                if hasattr(mod, "lora_A"):
                    lora_modules[name] = mod
                    for a in self.adapters:
                        if a in mod.lora_A:
                            ranks[a] = max(ranks[a], mod.lora_A[a].weight.shape[0])
            col = 0
            for a in self.adapters:
                self.adapter_cols[a] = (col, col + ranks[a])
                col += ranks[a]
            self.lora_rank = col
        self.layers: list[_Layer] = []
        for layer in core.layers:
            L = _Layer()
            L.ln1 = layer.input_layernorm.weight
            L.ln2 = layer.post_attention_layernorm.weight
            att, mlp = layer.self_attn, layer.mlp
            L.q_norm = att.q_norm.weight if hasattr(att, "q_norm") else None
            L.k_norm = att.k_norm.weight if hasattr(att, "k_norm") else None
            L.lin = {}
            for pname in _PROJECTIONS:
                mod = getattr(att if pname in _PROJECTIONS[:4] else mlp, pname)
                baselayer = getattr(mod, "base_layer", mod)
                lora = None
                if self.lora_rank and hasattr(mod, "lora_A"):
                    lora = self._stack_lora(mod, baselayer, device)
                L.lin[pname] = (baselayer.weight, baselayer.bias, lora)
            self.layers.append(L)

    def _stack_lora(self, mod, baselayer, device):
        out_f, in_f = baselayer.weight.shape
        A = torch.zeros(self.lora_rank, in_f, dtype=self.dtype, device=device)
        B = torch.zeros(out_f, self.lora_rank, dtype=self.dtype, device=device)
        any_adapter = False
        for a, (c0, _) in self.adapter_cols.items():
            if a not in mod.lora_A:
                continue
            wa = mod.lora_A[a].weight
            wb = mod.lora_B[a].weight
            r = wa.shape[0]
            A[c0:c0 + r] = wa.to(device=device, dtype=self.dtype)
            B[:, c0:c0 + r] = (wb.to(device=device, dtype=torch.float32) * float(mod.scaling[a])).to(self.dtype)
            any_adapter = True
        return (A, B) if any_adapter else None

    def rope_tables(self, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(max_len, device=device)[None]
        dummy = torch.zeros(1, dtype=self.dtype, device=device)
        cos, sin = self.rotary(dummy, pos)
        return cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()


def native_unsupported_reason(model, max_seq_len: int | None = None) -> str | None:
    """None when the native forward reproduces this model exactly; otherwise why not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in NATIVE_MODEL_TYPES:
        return f"model_type {mt!r} is not one of {NATIVE_MODEL_TYPES}"
    core = getattr(base, "model", None)
    if core is None or not hasattr(core, "layers") or not hasattr(base, "lm_head"):
        return "unexpected module layout"
    rope_type = getattr(core.rotary_emb, "rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        return f"rope type {rope_type!r} (position-dependent scaling) is not supported natively"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    sw = getattr(cfg, "sliding_window", None)
    if mt == "mistral" and sw is not None and (max_seq_len is None or sw < max_seq_len):
        return "sliding window shorter than the context"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {cfg.hidden_act!r}"
    for layer in core.layers:
        att = layer.self_attn
        if not all(hasattr(att, p) for p in _PROJECTIONS[:4]) or \
                not all(hasattr(layer.mlp, p) for p in _PROJECTIONS[4:]):
            return "unexpected layer layout"
    if len(set(getattr(base, "hf_device_map", {}).values())) > 1:
        return "weights spread over several devices (device_map='auto'): the model's own forward moves activations"
    if getattr(cfg, "quantization_config", None) is not None:
        return "quantized weights (bitsandbytes): the model's own forward dequantizes them"
    if hasattr(model, "peft_config"):
        for name, pc in model.peft_config.items():
            peft_type = getattr(pc, "peft_type", None)
            if peft_type is not None and str(getattr(peft_type, "value", peft_type)) != "LORA":
                return f"adapter {name!r} is {pc.peft_type}, not LoRA"
            if getattr(pc, "modules_to_save", None):
                return f"adapter {name!r} has modules_to_save"
            if getattr(pc, "use_dora", False):
                return f"adapter {name!r} uses DoRA"
        allowed = {f"{p}" for p in _PROJECTIONS}
        for name, mod in base.named_modules():
            if hasattr(mod, "lora_A"):
                if name.rsplit(".", 1)[-1] not in allowed or ".layers." not in f".{name}":
                    return f"LoRA on {name} (only the decoder projections are supported natively)"
                if getattr(mod, "merged", False):
                    return f"LoRA merged into {name}"
                if getattr(mod, "lora_embedding_A", None):
                    return "LoRA embeddings"
                for d in ("use_dora", "lora_bias"):
                    flags = getattr(mod, d, {}) or {}
                    if any(bool(v) for v in flags.values()):
                        return f"{d} on {name}"
    return None


# --------------------------------------------------------------------------------------------------- engine


class Engine:
    """Continuous-batching generation over one model on one device. See the module docstring."""

    def __init__(self, model, tokenizer, *, device: str, memory_budget_bytes: int, max_batch_size: int = 256,
                 use_graphs: bool | None = None, max_seq_len: int | None = None, prefill_tokens: int | None = None,
                 native: bool | None = None, kernels: str = "auto"):
        self.device = torch.device(device)
        self.backend = self.device.type
        if self.backend not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"device {device!r}: expected cpu, cuda or xpu")
        if self.backend != "cpu" and self.device.index is None:
            self.device = torch.device(self.backend, _device_module(self.backend).current_device())
        self.tokenizer = tokenizer
        self.budget = int(memory_budget_bytes)
        self.max_batch_size = int(max_batch_size)
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self._want_graphs = use_graphs
        self.use_graphs = _graphs_available(self.backend) if use_graphs is None else bool(use_graphs)
        if self.use_graphs and not _graphs_available(self.backend):
            raise ValueError(f"use_graphs=True but torch {torch.__version__} has no graphs for {self.backend}")
        self._want_native = native
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
        self._waiting: deque[_Seq] = deque()
        self._cancel_ids: set[str] = set()
        self._closed = False
        self._by_id: dict[str, list[_Seq]] = {}
        self.stats: dict[str, Any] = {
            "decode_steps": 0, "decode_rows": 0, "decode_seconds": 0.0, "prefill_calls": 0,
            "prefill_tokens": 0, "prefill_padded_tokens": 0, "prefill_seconds": 0.0, "graphs_captured": 0,
            "graph_capture_seconds": 0.0, "max_running": 0, "completed": 0, "errors": 0, "busy_seconds": 0.0,
            "peak_memory_bytes": 0, "peak_reserved_bytes": 0, "migrations": 0,
        }
        with self.model_lock:
            self._setup(model, first=True)
        self._thread = threading.Thread(target=self._loop, name="xpu-jobs-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ setup

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

        if path == "native":
            self.nat = _NativeModel(model, self.device)
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
            if not reuse:
                self._setup_hf(el)

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
        p = self.prefill_tokens
        prefill = int(1.5 * p * (3 * n.hidden + 3 * (n.hq + 2 * n.hkv) * n.head_dim + n.hq * n.head_dim
                                 + 4 * n.intermediate) * el)
        rows = min(slots, _PREFILL_PROMPTS)
        prefill += rows * n.vocab * 12
        sample = _SAMPLE_CHUNK * n.vocab * 48
        lora = 0
        if n.lora_rank:
            lora = 2 * n.lora_rank * (n.hidden * 4 + n.intermediate * 3 + n.hq * n.head_dim * 2) * el * n.n_layers
            lora += slots * n.lora_rank * el
        return logits + decode + prefill + sample + lora

    def _allocate_native(self, dtype, el) -> None:
        n = self.nat
        per_slot = self.kv_bytes_per_token * self.max_seq_len
        slots = self.max_batch_size
        # one slot more than requests: packed prefill writes its padding tokens' keys and values there
        while slots > 0 and (slots + 1) * per_slot + self._workspace_estimate(slots, el) > self.budget:
            slots -= 1
        if slots < 1:
            raise ValueError(
                f"memory_budget_bytes={self.budget} cannot hold one request of max_seq_len={self.max_seq_len} "
                f"({per_slot} bytes of KV cache) plus the workspace ({self._workspace_estimate(1, el)} bytes); "
                f"raise the budget or lower max_seq_len")
        self.num_slots = slots
        dev = self.device
        self._reset_peak()
        self._mem_base = self._allocated()
        self.cache = torch.zeros(n.n_layers, 2, slots + 1, n.hkv, self.max_seq_len, n.head_dim, dtype=dtype,
                                 device=dev)
        self.ids_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.pos_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.next_buf = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.logits_buf = torch.zeros(slots, n.vocab, dtype=dtype, device=dev)
        self.slot_ar = torch.arange(slots, device=dev)
        self.head_ar = torch.arange(n.hkv, device=dev)
        self.len_ar = torch.arange(self.max_seq_len, device=dev)
        self.cos, self.sin = n.rope_tables(self.max_seq_len, dev)
        self.lora_mask = torch.zeros(slots + 1, max(1, n.lora_rank), dtype=dtype, device=dev)
        # packed prefill's inputs: token ids, positions and slots per row; the prompts' bounds (cu_seqlens), with
        # room for the padding up to a captured size, cut into pieces no longer than a prompt may be
        self._pf_rows = torch.zeros(3, self.prefill_tokens, dtype=torch.int64, device=dev)
        self._pf_seqs = _PREFILL_PROMPTS + -(-self.prefill_tokens // self.max_seq_len)
        self._pf_cu = torch.zeros(self._pf_seqs + 1, dtype=torch.int32, device=dev)
        self._pf_logits = torch.zeros(_PREFILL_PROMPTS, n.vocab, dtype=torch.float32, device=dev)
        self._slots: list[_Seq | None] = [None] * slots
        self._free = list(range(slots))
        heapq.heapify(self._free)
        self._inflight: list[_Out] = []
        self._graphs: dict[tuple[int, int], Any] = {}
        self._graph_pool = _device_module(self.backend).graph_pool_handle() if self.use_graphs else None
        self._buckets = batch_buckets(slots)
        self.stats.update(num_slots=slots, max_seq_len=self.max_seq_len, budget_bytes=self.budget,
                          kv_cache_bytes=self.cache.numel() * el,
                          workspace_estimate_bytes=self._workspace_estimate(slots, el))

    def _setup_hf(self, el) -> None:
        import inspect

        self._cohorts: list[dict] = []
        params = inspect.signature(self.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.num_slots = self.max_batch_size
        self._reset_peak()
        self._mem_base = self._allocated()
        cfg = self.base.config
        wide = max(cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
        ws = self.prefill_tokens * wide * el * 12 + 64 * self.vocab_size * 12
        self._hf_kv_budget = self.budget - ws
        if self._hf_kv_budget < self.kv_bytes_per_token * 16:
            raise ValueError(f"memory_budget_bytes={self.budget} leaves no room for a KV cache after the "
                             f"{ws}-byte workspace")
        self.stats.update(num_slots=self.num_slots, max_seq_len=self.max_seq_len, budget_bytes=self.budget,
                          kv_cache_bytes=0, workspace_estimate_bytes=ws)

    def _refresh_lora_masks(self) -> None:
        self.lora_mask = torch.zeros(self.num_slots + 1, max(1, self.nat.lora_rank), dtype=self.cache.dtype,
                                     device=self.device)
        for seq in self._slots:
            if seq is None or seq.finished:
                continue
            if seq.req.adapter is not None and seq.req.adapter not in self.nat.adapter_cols:
                self._finish(seq, "error", f"adapter {seq.req.adapter!r} was removed while the request ran")
                continue
            self._set_mask_row(seq)

    def _set_mask_row(self, seq: _Seq) -> None:
        self.lora_mask[seq.slot].zero_()
        if seq.req.adapter is not None:
            c0, c1 = self.nat.adapter_cols[seq.req.adapter]
            self.lora_mask[seq.slot, c0:c1] = 1

    # ------------------------------------------------------------------------------------------ memory

    def _allocated(self) -> int:
        if self.backend == "cpu":
            return 0
        return int(_device_module(self.backend).memory_allocated(self.device))

    def _reset_peak(self) -> None:
        if self.backend != "cpu":
            _device_module(self.backend).reset_peak_memory_stats(self.device)
            self._reserved_base = int(_device_module(self.backend).memory_reserved(self.device))

    def _update_peak(self) -> None:
        if self.backend == "cpu":
            return
        mod = _device_module(self.backend)
        self.stats["peak_memory_bytes"] = max(self.stats["peak_memory_bytes"],
                                              int(mod.max_memory_allocated(self.device)) - self._mem_base)
        self.stats["peak_reserved_bytes"] = max(self.stats["peak_reserved_bytes"],
                                                int(mod.max_memory_reserved(self.device)) - self._reserved_base)

    # ------------------------------------------------------------------------------------ public calls

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        seq = _Seq(request, fut)
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
            self._sync()
            self._setup(model, first=False)

    def warmup(self, lengths: list[int] | None = None, batch_sizes: list[int] | None = None) -> None:
        """Capture decode graphs ahead of time (native path with graphs only), so no request waits for a capture
        (about 0.1 s each for a 0.6B model on an H200). A failure is left to the first real step, which falls back
        (torch ops, then eager) and says why in stats."""
        if self.path != "native" or not self.use_graphs:
            return
        with self.model_lock, torch.no_grad():
            lens = [0] if self._tri is not None else [length_bucket(n, self.max_seq_len)
                                                      for n in (lengths or [self.max_seq_len])]
            try:
                for L in lens:
                    for B in sorted(batch_sizes or self._buckets, reverse=True):
                        self._graph(B, L)
                if self._graph_prefill:
                    for size in reversed(self._prefill_sizes()):
                        self._stage_rows([], size)  # all padding: only the spare slot is written
                        self._prefill_graph(size)
            except Exception as e:
                log.warning("engine: graph warm-up failed (%s: %s); capturing on first use", type(e).__name__, e)

    def benchmark_step(self, batch_size: int | None = None, length: int | None = None, iters: int = 20) -> float:
        """Seconds per decode step (graph replay, or the eager forward) for `batch_size` rows whose caches hold
        `length` tokens. The engine must be idle: it writes only into free cache slots."""
        if self.path != "native":
            raise RuntimeError("benchmark_step needs the native path")
        with self.model_lock, torch.no_grad():
            if self._inflight or any(s is not None for s in self._slots):
                raise RuntimeError("the engine is busy")
            B = self._bucket(min(batch_size or self.num_slots, self.num_slots))
            L = min(length or self.max_seq_len, self.max_seq_len)
            self.pos_buf[:B] = L - 1
            self.ids_buf[:B] = torch.randint(0, self.vocab_size, (B,), device=self.device)
            Lb = 0 if self._tri is not None else (length_bucket(L, self.max_seq_len) if self.use_graphs else L)
            for _ in range(2):
                self._run_decode(B, Lb)
            self._sync()
            t = time.perf_counter()
            for _ in range(iters):
                self._run_decode(B, Lb)
            self._sync()
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
                        self._iterate_hf()
                except Exception as e:  # never let one bad step kill the engine
                    log.exception("engine step failed")
                    self._fail_running(f"{type(e).__name__}: {e}")
                self._update_peak()
            self.stats["busy_seconds"] += time.perf_counter() - t0
        with self.model_lock:
            self._fail_running("engine closed")
            with self._cv:
                waiting = list(self._waiting)
                self._waiting.clear()
            for seq in waiting:
                self._finish(seq, "error", "engine closed")

    def _has_work(self) -> bool:
        if self._waiting or self._cancel_ids:
            return True
        if self.path == "native":
            return bool(self._inflight) or any(s is not None for s in self._slots)
        return bool(self._cohorts)

    def _sync(self) -> None:
        if self.backend != "cpu":
            _device_module(self.backend).synchronize(self.device)

    # ------------------------------------------------------------------------------ shared bookkeeping

    def _validate(self, seq: _Seq) -> str | None:
        req, p = seq.req, seq.req.params
        ids = req.prompt_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            return "prompt_ids must be a non-empty list of token ids"
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
            return f"prompt_ids must be integers in [0, {self.vocab_size})"
        if len(ids) >= self.max_seq_len:
            return (f"the prompt has {len(ids)} tokens; this engine holds at most {self.max_seq_len} tokens per "
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
        seq.limit = min(p.max_new_tokens, self.max_seq_len - len(ids) + 1)
        return None

    def _result(self, seq: _Seq, reason: str, error: str | None, text: str | None = None) -> GenerationResult:
        if text is None:
            text = self._decode(seq.out) if reason != "error" else ""
        return GenerationResult(request_id=seq.req.request_id, output_ids=list(seq.out), text=text,
                                finish_reason=reason, prompt_tokens=seq.prompt_len,
                                completion_tokens=len(seq.out), error=error)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, seq: _Seq, reason: str, error: str | None = None, text: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        if seq.slot >= 0 and self.path == "native" and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
            heapq.heappush(self._free, seq.slot)
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
            result = self._result(seq, reason, error, text)
        except Exception as e:  # a tokenizer failure must still finish the request
            result = GenerationResult(seq.req.request_id, list(seq.out), "", "error", seq.prompt_len,
                                      len(seq.out), f"decoding the output failed: {e}")
        if not seq.fut.done():
            seq.fut.set_result(result)

    def _accept(self, seq: _Seq, tok: int) -> None:
        """A new token for `seq`; finishes it on EOS, a stop string or its length limit."""
        if seq.finished:
            return
        seq.out.append(tok)
        if tok in self.eos_ids and not seq.ignore_eos:
            self._finish(seq, "stop")
            return
        if seq.stops:
            text = self._decode(seq.out)
            hits = [i for i in (text.find(s) for s in seq.stops) if i >= 0]
            if hits:
                self._finish(seq, "stop", text=text[:min(hits)])
                return
        if len(seq.out) >= seq.limit:
            self._finish(seq, "length")

    def _take_cancels(self) -> set[str]:
        with self._cv:
            ids, self._cancel_ids = self._cancel_ids, set()
            if not ids:
                return ids
            cancelled = [s for s in self._waiting if s.req.request_id in ids]
            self._waiting = deque(s for s in self._waiting if s.req.request_id not in ids)
        for seq in cancelled:
            self._finish(seq, "cancelled")
        return ids

    def _pop_waiting(self, max_n: int) -> list[_Seq]:
        """Up to max_n valid waiting requests (invalid ones are finished with an error on the way)."""
        got: list[_Seq] = []
        while len(got) < max_n:
            with self._cv:
                if not self._waiting:
                    break
                seq = self._waiting.popleft()
            err = self._validate(seq)
            if err:
                self._finish(seq, "error", err)
            else:
                got.append(seq)
        return got

    def _push_back(self, seqs: list[_Seq]) -> None:
        with self._cv:
            self._waiting.extendleft(reversed(seqs))

    def _fail_running(self, error: str) -> None:
        if self.path == "native":
            for seq in list(self._slots):
                if seq is not None:
                    self._finish(seq, "error", error)
            for out in self._inflight:
                for _, seq in out.rows:
                    self._finish(seq, "error", error)
            self._inflight = []
        else:
            for c in self._cohorts:
                for seq in c["seqs"]:
                    self._finish(seq, "error", error)
            self._cohorts = []

    def _pick(self, logits: torch.Tensor, greedy: torch.Tensor | None, seqs: list[tuple[int, _Seq]],
              steps: list[int]) -> torch.Tensor:
        """Tokens for rows of `logits` ([N, V]); rows listed in `seqs` with temperature > 0 are sampled."""
        toks = torch.argmax(logits, dim=-1) if greedy is None else greedy
        samp = [(i, s, k) for (i, s), k in zip(seqs, steps, strict=True) if s.temperature > 0]
        if samp:
            rows = _to_device([i for i, _, _ in samp], torch.int64, logits.device)
            drawn = sample_tokens(logits.index_select(0, rows).float(), [s.temperature for _, s, _ in samp],
                                  [s.top_p for _, s, _ in samp], [s.seed for _, s, _ in samp],
                                  [k for _, _, k in samp])
            toks = toks.clone() if greedy is None else toks
            toks.index_copy_(0, rows, drawn)
        return toks

    # --------------------------------------------------------------------------------- native forward

    def _lin(self, x, spec, mask):
        w, b, lora = spec
        y = F.linear(x, w, b)
        if lora is not None:
            y = y + F.linear(F.linear(x, lora[0]) * mask, lora[1])
        return y

    def _prefill_forward(self, ids: torch.Tensor, slots: torch.Tensor, start: int,
                         last: torch.Tensor | None) -> torch.Tensor | None:
        """Prompt tokens ids [n, L] at positions start..start+L-1 of cache slots `slots`; writes the KV cache.
        Returns float32 logits [n, V] at positions `last` (indices into L), or None."""
        if self._tri is not None:
            return self._prefill_forward_fused(ids, slots, start, last)
        n, L = ids.shape
        nat = self.nat
        hq, hkv, d = nat.hq, nat.hkv, nat.head_dim
        Lmax = self.max_seq_len
        x = F.embedding(ids, nat.embed)
        cos = self.cos[start:start + L][None, None]
        sin = self.sin[start:start + L][None, None]
        mask = self.lora_mask.index_select(0, slots)[:, None, :] if nat.lora_rank else None
        idx = ((slots[:, None, None] * hkv + self.head_ar[None, :, None]) * Lmax
               + (start + self.len_ar[:L])[None, None, :]).reshape(-1)
        attn_mask = None
        if start > 0:
            q_pos = start + self.len_ar[:L]
            attn_mask = self.len_ar[:start + L][None, :] <= q_pos[:, None]
        for li, layer in enumerate(nat.layers):
            kc = self.cache[li, 0]
            vc = self.cache[li, 1]
            h = _rms(x, layer.ln1, nat.eps)
            q = self._lin(h, layer.lin["q_proj"], mask).view(n, L, hq, d)
            k = self._lin(h, layer.lin["k_proj"], mask).view(n, L, hkv, d)
            v = self._lin(h, layer.lin["v_proj"], mask).view(n, L, hkv, d)
            if layer.q_norm is not None:
                q = _rms(q, layer.q_norm, nat.eps)
                k = _rms(k, layer.k_norm, nat.eps)
            q = q.transpose(1, 2)
            k = k.transpose(1, 2)
            v = v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc.view(-1, d).index_copy_(0, idx, k.reshape(-1, d))
            vc.view(-1, d).index_copy_(0, idx, v.reshape(-1, d))
            if start == 0:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=L > 1, scale=nat.scaling,
                                                   enable_gqa=hq != hkv)
            else:
                K = kc[slots, :, :start + L]
                V = vc[slots, :, :start + L]
                a = F.scaled_dot_product_attention(q, K, V, attn_mask=attn_mask, scale=nat.scaling,
                                                   enable_gqa=hq != hkv)
            a = a.transpose(1, 2).reshape(n, L, hq * d)
            x = x + self._lin(a, layer.lin["o_proj"], mask)
            h = _rms(x, layer.ln2, nat.eps)
            g = nat.act(self._lin(h, layer.lin["gate_proj"], mask)) * self._lin(h, layer.lin["up_proj"], mask)
            x = x + self._lin(g, layer.lin["down_proj"], mask)
        if last is None:
            return None
        xl = x[torch.arange(n, device=x.device), last]
        return F.linear(_rms(xl, nat.norm, nat.eps), nat.lm_head, nat.lm_bias).float()

    def _qkv_into_cache(self, h, layer, mask, pos, idx, kc, vc):
        """The fused paths' attention inputs for the token rows of `h`: q and k normed and rotated at `pos`,
        k and v written into this layer's cache at `idx`. Returns q, k, v as [rows, heads, head_dim]."""
        nat, tri = self.nat, self._tri
        rows, d = h.shape[0], nat.head_dim
        q = tri.norm_rope(self._lin(h, layer.lin["q_proj"], mask).view(rows, nat.hq, d), layer.q_norm, self.cos,
                          self.sin, pos, nat.eps)
        k = tri.norm_rope(self._lin(h, layer.lin["k_proj"], mask).view(rows, nat.hkv, d), layer.k_norm, self.cos,
                          self.sin, pos, nat.eps)
        v = self._lin(h, layer.lin["v_proj"], mask).view(rows, nat.hkv, d)
        kc.view(-1, d).index_copy_(0, idx, k.view(-1, d))
        vc.view(-1, d).index_copy_(0, idx, v.view(-1, d))
        return q, k, v

    def _prefill_forward_fused(self, ids: torch.Tensor, slots: torch.Tensor, start: int,
                               last: torch.Tensor | None) -> torch.Tensor | None:
        """_prefill_forward with the Triton kernels (token-major layout, no transposes before the cache write)."""
        nat, tri = self.nat, self._tri
        n, L = ids.shape
        T = n * L
        hq, hkv, d = nat.hq, nat.hkv, nat.head_dim
        Lmax = self.max_seq_len
        positions = start + self.len_ar[:L]
        pos_tok = positions.repeat(n)
        x = F.embedding(ids.reshape(T), nat.embed)
        mask = self.lora_mask.index_select(0, slots).repeat_interleave(L, dim=0) if nat.lora_rank else None
        idx = ((slots[:, None, None] * hkv + self.head_ar[None, None, :]) * Lmax
               + positions[None, :, None]).reshape(-1)
        attn_mask = None
        if start > 0:
            attn_mask = self.len_ar[:start + L][None, :] <= positions[:, None]

        def attend(li, q, k, v):
            q4 = q.view(n, L, hq, d).transpose(1, 2)
            if start == 0:
                a = F.scaled_dot_product_attention(q4, k.view(n, L, hkv, d).transpose(1, 2),
                                                   v.view(n, L, hkv, d).transpose(1, 2), is_causal=L > 1,
                                                   scale=nat.scaling, enable_gqa=hq != hkv)
            else:
                a = F.scaled_dot_product_attention(q4, self.cache[li, 0, slots, :, :start + L],
                                                   self.cache[li, 1, slots, :, :start + L], attn_mask=attn_mask,
                                                   scale=nat.scaling, enable_gqa=hq != hkv)
            return a.transpose(1, 2).reshape(T, hq * d)

        x = self._fused_layers(x, mask, pos_tok, idx, attend)
        if last is None:
            return None
        xl = x.view(n, L, -1)[torch.arange(n, device=x.device), last]
        return F.linear(tri.rms_norm(xl, nat.norm, nat.eps), nat.lm_head, nat.lm_bias).float()

    def _fused_layers(self, x: torch.Tensor, mask, pos: torch.Tensor, idx: torch.Tensor,
                      attend: Callable) -> torch.Tensor:
        """The decoder layers over token rows x [T, hidden] with the Triton kernels; each layer's k and v go into
        the cache at idx, and attend(layer_index, q, k, v) returns the attention output [T, hq * head_dim]."""
        nat, tri = self.nat, self._tri
        h = tri.rms_norm(x, nat.layers[0].ln1, nat.eps)
        n_layers = len(nat.layers)
        for li, layer in enumerate(nat.layers):
            q, k, v = self._qkv_into_cache(h, layer, mask, pos, idx, self.cache[li, 0], self.cache[li, 1])
            a = attend(li, q, k, v)
            x, h = tri.rms_norm(x, layer.ln2, nat.eps, residual=self._lin(a, layer.lin["o_proj"], mask))
            g = tri.silu_mul(self._lin(h, layer.lin["gate_proj"], mask), self._lin(h, layer.lin["up_proj"], mask))
            down = self._lin(g, layer.lin["down_proj"], mask)
            if li + 1 < n_layers:
                x, h = tri.rms_norm(x, nat.layers[li + 1].ln1, nat.eps, residual=down)
            else:
                x = x + down
        return x

    def _prefill_packed(self, chunk: list[_Seq]) -> tuple[torch.Tensor, int]:
        """_prefill_forward_fused for whole prompts packed end to end: rows are the prompts' tokens, each at its
        own position and slot, and attention keeps every prompt to itself. Returns float32 logits [n, V] at each
        prompt's last token, and the rows computed. With graphs, the rows are padded up to a captured size and the
        prefill is one graph replay: run eagerly it is some 450 launches, host work that bounds it (about 25 ms on
        an H200's host)."""
        T = sum(s.prompt_len for s in chunk)
        size = next(b for b in self._prefill_sizes() if b >= T) if self._graph_prefill else T
        self._stage_rows(chunk, size)
        if self._graph_prefill:
            try:
                self._prefill_graph(size).replay()
                return self._pf_logits[:len(chunk)], size
            except Exception as e:  # this prefill and later ones run eagerly
                log.warning("engine: prefill graph failed (%s: %s); prefill runs eagerly", type(e).__name__, e)
                self.stats["prefill_graphs_error"] = f"{type(e).__name__}: {e}"
                self._graph_prefill = False
                self._sync()
        self._prefill_packed_body(size)
        return self._pf_logits[:len(chunk)], size

    def _prefill_sizes(self) -> list[int]:
        """Row counts a packed prefill is captured for: padding to the next costs at most 1024 rows above 1024."""
        P = self.prefill_tokens
        return [b for b in [256, 512] + list(range(1024, P, 1024)) if b < P] + [P]

    def _stage_rows(self, chunk: list[_Seq], size: int) -> None:
        """Packed prefill's inputs for `chunk` into the static buffers, padded to `size` rows: padding rows are
        token 0 in the spare slot, in pieces no longer than a prompt may be."""
        lens = [s.prompt_len for s in chunk]
        T, L = sum(lens), self.max_seq_len
        pad = size - T
        rows = torch.empty(3, size, dtype=torch.int64)
        rows[:, T:] = torch.stack([torch.zeros(pad, dtype=torch.int64), torch.arange(pad) % L,
                                   torch.full((pad,), self.num_slots)])
        if chunk:
            rows[0, :T] = torch.tensor([t for s in chunk for t in s.req.prompt_ids])
            rows[1, :T] = torch.cat([torch.arange(n) for n in lens])
            rows[2, :T] = torch.repeat_interleave(torch.tensor([s.slot for s in chunk]), torch.tensor(lens))
        pieces = lens + [L] * (pad // L) + ([pad % L] if pad % L else [])
        cu = torch.full((self._pf_seqs + 1,), size, dtype=torch.int32)
        cu[0] = 0
        cu[1:len(pieces) + 1] = torch.tensor(pieces).cumsum(0)
        if self.backend != "cpu":
            rows, cu = rows.pin_memory(), cu.pin_memory()
        self._pf_rows[:, :size].copy_(rows, non_blocking=True)
        self._pf_cu.copy_(cu, non_blocking=True)

    def _prefill_packed_body(self, size: int) -> None:
        """Packed prefill over the first `size` staged rows: writes the KV cache, and the logits at the end of each
        of the first _PREFILL_PROMPTS pieces into _pf_logits."""
        nat = self.nat
        ids, pos, slot = self._pf_rows[0, :size], self._pf_rows[1, :size], self._pf_rows[2, :size]
        idx = ((slot[:, None] * nat.hkv + self.head_ar[None, :]) * self.max_seq_len + pos[:, None]).reshape(-1)
        mask = self.lora_mask.index_select(0, slot) if nat.lora_rank else None
        width = nat.hq * nat.head_dim
        x = self._fused_layers(F.embedding(ids, nat.embed), mask, pos, idx,
                               lambda li, q, k, v: self._packed(q, k, v, self._pf_cu,
                                                                self.max_seq_len).reshape(size, width))
        xl = x.index_select(0, self._pf_cu[1:_PREFILL_PROMPTS + 1].long() - 1)
        self._pf_logits.copy_(F.linear(self._tri.rms_norm(xl, nat.norm, nat.eps), nat.lm_head, nat.lm_bias))

    def _prefill_graph(self, size: int):
        key = ("prefill", size)
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self._prefill_packed_body(size))
        return self._graphs[key]

    def _decode_body(self, B: int, Lb: int) -> None:
        """One decode step for slots [0, B): reads ids_buf/pos_buf, writes the KV cache, logits_buf and next_buf.
        Side effects other than those outputs are idempotent, so warm-up runs before a capture are harmless."""
        if self._tri is not None:
            return self._decode_body_fused(B)
        nat = self.nat
        hq, hkv, d = nat.hq, nat.hkv, nat.head_dim
        G = hq // hkv
        Lmax = self.max_seq_len
        pos = self.pos_buf[:B].clamp(max=Lmax - 1)
        x = F.embedding(self.ids_buf[:B], nat.embed)
        cos = self.cos[pos][:, None, :]
        sin = self.sin[pos][:, None, :]
        idx = ((self.slot_ar[:B, None] * hkv + self.head_ar[None, :]) * Lmax + pos[:, None]).reshape(-1)
        valid = self.len_ar[:Lb][None, :] <= pos[:, None]
        addmask = torch.zeros(B, Lb, dtype=x.dtype, device=x.device).masked_fill(~valid, float("-inf"))
        addmask = addmask[:, None, None, :]
        mask = self.lora_mask[:B] if nat.lora_rank else None
        for li, layer in enumerate(nat.layers):
            kc = self.cache[li, 0]
            vc = self.cache[li, 1]
            h = _rms(x, layer.ln1, nat.eps)
            q = self._lin(h, layer.lin["q_proj"], mask).view(B, hq, d)
            k = self._lin(h, layer.lin["k_proj"], mask).view(B, hkv, d)
            v = self._lin(h, layer.lin["v_proj"], mask).view(B, hkv, d)
            if layer.q_norm is not None:
                q = _rms(q, layer.q_norm, nat.eps)
                k = _rms(k, layer.k_norm, nat.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc.view(-1, d).index_copy_(0, idx, k.reshape(-1, d))
            vc.view(-1, d).index_copy_(0, idx, v.reshape(-1, d))
            qg = q.view(B, hkv, G, d)  # the query heads of one KV head share its keys: no repeat_kv copy
            K = kc[:B, :, :Lb].reshape(B * hkv, Lb, d)
            V = vc[:B, :, :Lb].reshape(B * hkv, Lb, d)
            s = torch.bmm(qg.reshape(B * hkv, G, d), K.transpose(1, 2)).view(B, hkv, G, Lb)
            s = s * nat.scaling + addmask
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(x.dtype)
            a = torch.bmm(p.view(B * hkv, G, Lb), V).reshape(B, hq * d)
            x = x + self._lin(a, layer.lin["o_proj"], mask)
            h = _rms(x, layer.ln2, nat.eps)
            g = nat.act(self._lin(h, layer.lin["gate_proj"], mask)) * self._lin(h, layer.lin["up_proj"], mask)
            x = x + self._lin(g, layer.lin["down_proj"], mask)
        self._logits_and_greedy(_rms(x, nat.norm, nat.eps), B)

    def _decode_body_fused(self, B: int) -> None:
        """_decode_body with the Triton kernels: ~15 kernels a layer instead of ~50."""
        nat, tri = self.nat, self._tri
        hq, hkv, d = nat.hq, nat.hkv, nat.head_dim
        G = hq // hkv
        Lmax = self.max_seq_len
        pos = self.pos_buf[:B].clamp(max=Lmax - 1)
        lens = pos + 1
        x = F.embedding(self.ids_buf[:B], nat.embed)
        h = tri.rms_norm(x, nat.layers[0].ln1, nat.eps)
        idx = ((self.slot_ar[:B, None] * hkv + self.head_ar[None, :]) * Lmax + pos[:, None]).reshape(-1)
        mask = self.lora_mask[:B] if nat.lora_rank else None
        n_layers = len(nat.layers)
        for li, layer in enumerate(nat.layers):
            kc, vc = self.cache[li, 0], self.cache[li, 1]
            q, _, _ = self._qkv_into_cache(h, layer, mask, pos, idx, kc, vc)
            a = tri.decode_attention(q.view(B, hkv, G, d), kc, vc, lens, nat.scaling).view(B, hq * d)
            x, h = tri.rms_norm(x, layer.ln2, nat.eps, residual=self._lin(a, layer.lin["o_proj"], mask))
            g = tri.silu_mul(self._lin(h, layer.lin["gate_proj"], mask), self._lin(h, layer.lin["up_proj"], mask))
            w_next = nat.layers[li + 1].ln1 if li + 1 < n_layers else nat.norm
            x, h = tri.rms_norm(x, w_next, nat.eps, residual=self._lin(g, layer.lin["down_proj"], mask))
        self._logits_and_greedy(h, B)

    def _logits_and_greedy(self, h: torch.Tensor, B: int) -> None:
        """The decode step's tail, into the graph's static buffers: logits of the final-normed hidden states `h`
        for slots [0, B), and their greedy tokens."""
        nat = self.nat
        out = self.logits_buf[:B]
        if nat.lm_bias is None:
            torch.mm(h, nat.lm_head.t(), out=out)
        else:
            torch.addmm(nat.lm_bias, h, nat.lm_head.t(), out=out)
        torch.argmax(out, dim=-1, out=self.next_buf[:B])

    def _graph(self, B: int, Lb: int):
        key = (B, Lb)
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self._decode_body(B, Lb))
        return self._graphs[key]

    def _capture(self, body: Callable[[], None]):
        """`body` as a device graph in the shared pool (graphs never run at once, so they share temporaries)."""
        t0 = time.perf_counter()
        mod = _device_module(self.backend)
        stream = mod.Stream(device=self.device)
        stream.wait_stream(mod.current_stream(self.device))
        with mod.stream(stream):
            for _ in range(2):
                body()
        mod.current_stream(self.device).wait_stream(stream)
        g = mod.CUDAGraph() if self.backend == "cuda" else mod.XPUGraph()
        kwargs = {"pool": self._graph_pool}
        if self.backend == "cuda":
            kwargs["capture_error_mode"] = "thread_local"
        with mod.graph(g, **kwargs):
            body()
        self.stats["graphs_captured"] += 1
        self.stats["graph_capture_seconds"] += time.perf_counter() - t0
        return g

    def _disable_triton(self, e: Exception) -> bool:
        """After a Triton kernel failed to build or capture here: keep serving with torch ops, if allowed."""
        if self._tri is None or self._want_attention == "triton":
            return False
        log.warning("engine: triton kernels failed (%s: %s); using torch ops", type(e).__name__, e)
        self._tri = None
        self._packed = None
        self._graph_prefill = False
        self.attention = "torch"
        self.stats["kernels"] = "torch"
        self.stats["kernels_error"] = f"{type(e).__name__}: {e}"
        self._graphs = {}
        self._sync()
        return True

    def _run_decode(self, B: int, Lb: int) -> None:
        """One decode step (graph replay or eager). If the Triton kernels or graph capture fail on this machine
        and were not asked for explicitly, fall back (torch ops, then eager) and keep serving."""
        while True:
            try:
                if self.use_graphs:
                    self._graph(B, Lb).replay()
                else:
                    self._decode_body(B, Lb)
                return
            except Exception as e:
                if self._disable_triton(e):
                    Lb = length_bucket(Lb or self.max_seq_len, self.max_seq_len)
                    continue
                if self.use_graphs and self._want_graphs is None:
                    log.warning("engine: graph capture failed (%s: %s); running the decode step eagerly",
                                type(e).__name__, e)
                    self.use_graphs = False
                    self.stats["graphs_error"] = f"{type(e).__name__}: {e}"
                    self._graphs = {}
                    self._sync()
                    Lb = Lb or self.max_seq_len
                    continue
                raise

    # ------------------------------------------------------------------------------ native scheduling

    def _iterate_native(self) -> None:
        run = [s for s in self._slots if s is not None and not s.finished and s.n_launched < s.limit]
        new: list[_Out] = []
        if run:
            run = self._compact(run)
            new.append(self._launch_decode(run))
        old, self._inflight = self._inflight, new
        for out in old:
            toks = out.tokens()
            for i, seq in out.rows:
                self._accept(seq, toks[i])
        cancels = self._take_cancels()
        if cancels:
            for seq in list(self._slots):
                if seq is not None and seq.req.request_id in cancels:
                    self._finish(seq, "cancelled")
        self._admit_native()

    def _compact(self, run: list[_Seq]) -> list[_Seq]:
        """Move requests from high slots into free low ones when that shrinks the batch bucket."""
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
            used = min(seq.cache_len + 1, self.max_seq_len)
            self.cache[:, :, dst, :, :used].copy_(self.cache[:, :, src, :, :used])
            self.ids_buf[dst] = self.ids_buf[src]
            self.pos_buf[dst] = self.pos_buf[src]
            self.lora_mask[dst] = self.lora_mask[src]
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

    def _launch_decode(self, run: list[_Seq]) -> _Out:
        t0 = time.perf_counter()
        B = self._bucket(max(s.slot for s in run) + 1)
        need = max(s.cache_len for s in run) + 1
        if self._tri is not None:
            Lb = 0  # the kernel reads each row's own length: one graph per batch size
        else:
            Lb = length_bucket(need, self.max_seq_len) if self.use_graphs else need
        self._run_decode(B, Lb)
        rows = [(s.slot, s) for s in run]
        toks = self._pick(self.logits_buf[:B], self.next_buf[:B], rows, [s.n_launched for s in run])
        self.ids_buf[:B].copy_(toks)
        self.pos_buf[:B] += 1
        for s in run:
            s.cache_len += 1
            s.n_launched += 1
        out = _Out(self.ids_buf[:B], rows, self.backend)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(run)
        self.stats["max_running"] = max(self.stats["max_running"], len(run))
        self.stats["decode_seconds"] += time.perf_counter() - t0
        return out

    def _admit_native(self) -> None:
        if not self._free:
            return
        with self._cv:
            if not self._waiting:
                return
        cands = self._pop_waiting(len(self._free))
        if not cands:
            return
        t0 = time.perf_counter()
        P = self.prefill_tokens
        long = [s for s in cands if s.prompt_len > P]
        short = sorted((s for s in cands if s.prompt_len <= P), key=lambda s: s.prompt_len)
        chunk: list[_Seq] = []
        if long:
            chunk = [long[0]]
        else:
            tokens = 0
            for s in short:
                # packed, a chunk costs its real tokens; padded, every prompt costs the longest (the last)
                cost = tokens + s.prompt_len if self._packed else (len(chunk) + 1) * s.prompt_len
                if cost > P or len(chunk) >= _PREFILL_PROMPTS:
                    break
                chunk.append(s)
                tokens += s.prompt_len
        taken = {id(s) for s in chunk}
        self._push_back([s for s in cands if id(s) not in taken])
        for seq in chunk:
            seq.slot = heapq.heappop(self._free)
            self._slots[seq.slot] = seq
            if self.nat.lora_rank:
                self._set_mask_row(seq)
        try:
            try:
                self._prefill(chunk)
            except Exception as e:
                if not self._disable_triton(e):
                    raise
                self._prefill(chunk)
        except Exception as e:
            log.exception("prefill failed")
            for seq in chunk:
                self._finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
        self.stats["prefill_seconds"] += time.perf_counter() - t0

    def _prefill(self, chunk: list[_Seq]) -> None:
        dev = self.device
        n = len(chunk)
        slots = _to_device([s.slot for s in chunk], torch.int64, dev)
        lens = [s.prompt_len for s in chunk]
        if n == 1 and lens[0] > self.prefill_tokens:
            ids_all = chunk[0].req.prompt_ids
            seg = self.prefill_tokens
            logits = None
            for start in range(0, lens[0], seg):
                piece = ids_all[start:start + seg]
                last = _to_device([len(piece) - 1], torch.int64, dev) if start + seg >= lens[0] else None
                logits = self._prefill_forward(_to_device([piece], torch.int64, dev), slots, start, last)
            padded = lens[0]
        elif self._packed is not None:
            logits, padded = self._prefill_packed(chunk)
        else:
            L = max(lens)
            ids = torch.zeros(n, L, dtype=torch.int64)
            for i, s in enumerate(chunk):
                ids[i, :s.prompt_len] = torch.tensor(s.req.prompt_ids)
            last = _to_device([x - 1 for x in lens], torch.int64, dev)
            if self.backend != "cpu":
                ids = ids.pin_memory()
            logits = self._prefill_forward(ids.to(dev, non_blocking=True), slots, 0, last)
            padded = n * L
        rows = list(enumerate(chunk))
        toks = self._pick(logits, None, rows, [0] * n)
        self.ids_buf.index_copy_(0, slots, toks)
        self.pos_buf.index_copy_(0, slots, _to_device(lens, torch.int64, dev))
        for s in chunk:
            s.cache_len = s.prompt_len
            s.n_launched = 1
        self._inflight.append(_Out(toks, rows, self.backend))
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(lens)
        self.stats["prefill_padded_tokens"] += padded

    # --------------------------------------------------------------------------------- fallback (HF)

    def _hf_forward(self, cache, **kw):
        kw[self._cache_kwarg] = cache
        return self.model(use_cache=True, return_dict=True, logits_to_keep=1, **kw).logits[:, -1, :]

    def _iterate_hf(self) -> None:
        from transformers import DynamicCache

        cancels = self._take_cancels()
        if cancels:
            for c in self._cohorts:
                for seq in c["seqs"]:
                    if seq.req.request_id in cancels:
                        self._finish(seq, "cancelled")
        # Admit a new cohort while rows and the KV budget allow it.
        running = sum(len(c["seqs"]) for c in self._cohorts)
        reserved = sum(c["reserve"] for c in self._cohorts)
        room = self.max_batch_size - running
        if room > 0:
            cands = self._pop_waiting(room)
            chunk, tokens = [], 0
            for s in sorted(cands, key=lambda s: s.prompt_len):
                need = (s.prompt_len + s.limit) * self.kv_bytes_per_token
                if need > self._hf_kv_budget:
                    self._finish(s, "error", f"the prompt plus max_new_tokens needs {need} bytes of KV cache, more "
                                             f"than the memory budget allows ({self._hf_kv_budget})")
                    continue
                if chunk and (len(chunk) + 1) * s.prompt_len > self.prefill_tokens:
                    break
                if reserved + tokens + need > self._hf_kv_budget:
                    break
                chunk.append(s)
                tokens += need
            taken = {id(s) for s in chunk}
            self._push_back([s for s in cands if id(s) not in taken and not s.finished])
            if chunk:
                t0 = time.perf_counter()
                try:
                    self._hf_prefill(chunk, tokens, DynamicCache)
                except Exception as e:
                    log.exception("prefill failed")
                    for seq in chunk:
                        self._finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
                self.stats["prefill_seconds"] += time.perf_counter() - t0
        # One decode step per cohort.
        for c in list(self._cohorts):
            if all(s.finished for s in c["seqs"]):
                self._cohorts.remove(c)
                continue
            t0 = time.perf_counter()
            c["mask"] = torch.cat([c["mask"], c["mask"].new_ones(c["mask"].shape[0], 1)], dim=1)
            c["pos"] = c["pos"] + 1
            kw = {}
            if self.is_peft:  # a cohort started before the base was wrapped runs on as base rows
                kw["adapter_names"] = c["adapters"] or ["__base__"] * len(c["seqs"])
            logits = self._hf_forward(input_ids=c["next"][:, None], attention_mask=c["mask"],
                                      position_ids=c["pos"][:, None], cache=c["cache"], **kw)
            rows = list(enumerate(c["seqs"]))
            toks = self._pick(logits, None, rows, [len(s.out) for s in c["seqs"]])
            c["next"] = toks
            host = toks.tolist()
            live = [s for s in c["seqs"] if not s.finished]
            for i, seq in rows:
                self._accept(seq, host[i])
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += len(live)
            self.stats["max_running"] = max(self.stats["max_running"], len(live))
            self.stats["decode_seconds"] += time.perf_counter() - t0
            if all(s.finished for s in c["seqs"]):
                self._cohorts.remove(c)

    def _hf_prefill(self, chunk: list[_Seq], reserve: int, cache_cls) -> None:
        dev = self.device
        n = len(chunk)
        L = max(s.prompt_len for s in chunk)
        pad = getattr(self.base.config, "pad_token_id", None)
        pad = 0 if pad is None else pad
        ids = torch.full((n, L), pad, dtype=torch.int64)
        mask = torch.zeros(n, L, dtype=torch.int64)
        for i, s in enumerate(chunk):  # left padding
            ids[i, L - s.prompt_len:] = torch.tensor(s.req.prompt_ids)
            mask[i, L - s.prompt_len:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = None
        if self.is_peft:
            adapters = [s.req.adapter if s.req.adapter is not None else "__base__" for s in chunk]
        cache = cache_cls(config=self.base.config)
        kw = {"adapter_names": adapters} if adapters is not None else {}
        logits = self._hf_forward(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, **kw)
        rows = list(enumerate(chunk))
        toks = self._pick(logits, None, rows, [0] * n)
        c = {"seqs": chunk, "cache": cache, "mask": mask, "pos": pos[:, -1], "next": toks, "adapters": adapters,
             "reserve": reserve}
        self._cohorts.append(c)
        host = toks.tolist()
        for i, seq in rows:
            seq.n_launched = 1
            self._accept(seq, host[i])
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(s.prompt_len for s in chunk)
        self.stats["prefill_padded_tokens"] += n * L
        if all(s.finished for s in chunk):
            self._cohorts.remove(c)
