"""The native path's model runner: the decoder of Llama-style models (llama, mistral, qwen2, qwen3, phi3, gemma)
written here against the model's own weight tensors, writing and reading the engine's KV cache. One decoder covers
the families, with four matmuls a layer: q/k/v and gate/up fused by rows (Phi-3's qkv_proj / gate_up_proj as they
are; other models' projections become row views of one fused weight, so memory is not doubled), o and down.
Gemma's (1 + w) norms are folded into the norm weights once, its embedding scale multiplies the embedded tokens,
and the MLP calls the model's own activation (GELU for Gemma; the fused Triton kernels cover SiLU only, so other
activations run on torch ops).

On cuda/xpu with triton (kernels="auto"/"triton"), triton_kernels.py supplies decode attention that reads only each
row's own cache length and fused RMSNorm / q-k norm + RoPE + cache write / SiLU*up kernels, and prefill packs
prompts end to end (torch's flash kernel, no padding between prompts); on cpu (and with kernels="torch") plain torch
ops reproduce transformers' arithmetic. LoRA adapters (PEFT) are applied per row inside one batch: every adapter's
A and B matrices are stacked per fused projection and a per-row mask selects the adapter's rank columns, i.e.
delta = ((x @ A_all^T) * mask) @ (scaling * B_all)^T, added in the second matmul.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from worker.engine import graphs
from worker.engine.graphs import length_bucket

if TYPE_CHECKING:
    from worker.engine.engine import Sequence

log = logging.getLogger(__name__)

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
PREFILL_PROMPTS = 64  # prompts per prefill call at most: bounds its [prompts, vocab] logits


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly transformers' LlamaRMSNorm / Qwen3RMSNorm.
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _norm_eps(norm) -> float | None:
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", None) if eps is None else eps


def norm_offset(norm) -> float | None:
    """How an RMSNorm module uses its weight, probed on the module itself: 0.0 for w * rms(x) (Llama), 1.0 for
    (1 + w) * rms(x) (Gemma), None for anything else."""
    w, eps = getattr(norm, "weight", None), _norm_eps(norm)
    if w is None or eps is None or w.dim() != 1 or w.device.type == "meta":
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        got = norm(x).float()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    for offset in (0.0, 1.0):
        if torch.allclose(got, h * (w.float() + offset), rtol=2e-2, atol=2e-2):
            return offset
    return None


def _base(linear):
    return getattr(linear, "base_layer", linear)


def _fuse_rows(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for projections that read the same input (q, k, v or gate, up), so each is one matmul
    a step. The modules' weights become row views of the fused tensor, so memory is not doubled, and an engine
    built later on the same base (or after update_model) finds them consecutive and views them again."""
    ws = [_base(m).weight for m in linears]
    w0 = ws[0]
    rows = sum(w.shape[0] for w in ws)
    consecutive = all(w.is_contiguous() and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
                      for w in ws) and all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
                                           for a, b in zip(ws, ws[1:]))
    if consecutive:
        fused = torch.as_strided(w0.detach(), (rows, w0.shape[1]), (w0.shape[1], 1))
    else:
        fused = torch.cat([w.detach() for w in ws])
        at = 0
        for m, w in zip(linears, ws):
            _base(m).weight.data = fused[at:at + w.shape[0]]
            at += w.shape[0]
    biases = [_base(m).bias for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                          for b, w in zip(biases, ws)])
    return fused, bias


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """The fused kernels' interface (triton_kernels.py) in plain torch ops with transformers' exact arithmetic, so
    one decoder implementation serves cpu and the devices without triton."""

    def __init__(self, act):
        self.act = act

    @staticmethod
    def rms_norm(x, w, eps, residual=None):
        if residual is None:
            return _rms(x, w, eps)
        x = x + residual
        return x, _rms(x, w, eps)

    @staticmethod
    def norm_rope(t, w, cos, sin, pos, eps):
        if w is not None:
            t = _rms(t, w, eps)
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        return t * c + _rotate_half(t) * s

    def silu_mul_rows(self, gu):
        half = gu.shape[-1] // 2
        return self.act(gu[:, :half]) * gu[:, half:]

    def qkv_rope_store(self, qkv, q_norm, k_norm, cos, sin, pos, eps, kv_index, k_cache, v_cache, hq, want_kv):
        T = qkv.shape[0]
        _, _, hkv, d = k_cache.shape
        q = self.norm_rope(qkv[:, :hq * d].view(T, hq, d), q_norm, cos, sin, pos, eps)
        k = self.norm_rope(qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d), k_norm, cos, sin, pos, eps)
        v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
        k_cache.view(-1, hkv, d).index_copy_(0, kv_index, k)
        v_cache.view(-1, hkv, d).index_copy_(0, kv_index, v)
        return (q, k, v) if want_kv else (q, None, None)


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


class _Layer:
    """One decoder layer's norms and its four matmuls: qkv and gate_up fused by rows, o and down; each as
    (weight, bias, LoRA (A, B) or None)."""
    __slots__ = ("ln1", "ln2", "q_norm", "k_norm", "qkv", "o", "gate_up", "down")


class NativeModel:
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
        self.eps = _norm_eps(core.norm)
        self.embed = core.embed_tokens.weight
        scale = getattr(core.embed_tokens, "embed_scale", None)  # Gemma: embeddings times sqrt(hidden)
        self.embed_scale = scale.to(device=device, dtype=self.dtype) if isinstance(scale, torch.Tensor) else None
        offset = norm_offset(core.norm)
        # (1 + w) norms as plain RMSNorm weights, computed once (in float32, as Gemma's norm does)
        self._fold = (lambda w: (w.float() + 1.0).to(w.dtype)) if offset else (lambda w: w)
        self.norm = self._fold(core.norm.weight)
        self.lm_head = base.lm_head.weight
        self.lm_bias = getattr(base.lm_head, "bias", None)
        self.rotary = core.rotary_emb
        mlp0 = core.layers[0].mlp
        self.act = getattr(mlp0, "act_fn", None) or mlp0.activation_fn
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
            L.ln1 = self._fold(layer.input_layernorm.weight)
            L.ln2 = self._fold(layer.post_attention_layernorm.weight)
            att, mlp = layer.self_attn, layer.mlp
            L.q_norm = self._fold(att.q_norm.weight) if hasattr(att, "q_norm") else None
            L.k_norm = self._fold(att.k_norm.weight) if hasattr(att, "k_norm") else None
            # Phi-3's fused projections are used as they are (LoRA on them takes the fallback path)
            qkv = [att.qkv_proj] if hasattr(att, "qkv_proj") else [att.q_proj, att.k_proj, att.v_proj]
            gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
            L.qkv = (*_fuse_rows(qkv), self._stack_lora(qkv, device))
            L.gate_up = (*_fuse_rows(gate_up), self._stack_lora(gate_up, device))
            L.o = (_base(att.o_proj).weight, _base(att.o_proj).bias, self._stack_lora([att.o_proj], device))
            L.down = (_base(mlp.down_proj).weight, _base(mlp.down_proj).bias, self._stack_lora([mlp.down_proj], device))
            self.layers.append(L)

    def _stack_lora(self, mods: list, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The LoRA matrices of projections sharing one input, for every adapter: A [parts * R, in] (part i's
        adapters in rows i*R + their rank columns) and B [sum of outputs, parts * R], block-diagonal by part and
        scaled, so that delta = ((x @ A^T) * mask repeated per part) @ B^T is one matmul each way."""
        if not self.lora_rank or not any(hasattr(m, "lora_A") for m in mods):
            return None
        R = self.lora_rank
        outs = [_base(m).weight.shape[0] for m in mods]
        A = torch.zeros(len(mods) * R, _base(mods[0]).weight.shape[1], dtype=self.dtype, device=device)
        B = torch.zeros(sum(outs), len(mods) * R, dtype=self.dtype, device=device)
        any_adapter = False
        row = 0
        for i, (mod, out) in enumerate(zip(mods, outs)):
            for a, (c0, _) in self.adapter_cols.items():
                if a not in getattr(mod, "lora_A", {}):
                    continue
                wa, wb = mod.lora_A[a].weight, mod.lora_B[a].weight
                c, r = i * R + c0, wa.shape[0]
                A[c:c + r] = wa.to(device=device, dtype=self.dtype)
                B[row:row + out, c:c + r] = (wb.to(device=device, dtype=torch.float32)
                                             * float(mod.scaling[a])).to(self.dtype)
                any_adapter = True
            row += out
        return (A, B) if any_adapter else None

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

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
    if mt in ("mistral", "phi3") and sw is not None and (max_seq_len is None or sw < max_seq_len):
        return "sliding window shorter than the context"
    for layer in core.layers:
        att, mlp = layer.self_attn, layer.mlp
        if not (all(hasattr(att, p) for p in _PROJECTIONS[:4]) or hasattr(att, "qkv_proj") and hasattr(att, "o_proj")) \
                or not (all(hasattr(mlp, p) for p in _PROJECTIONS[4:])
                        or hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj")) \
                or not callable(getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)):
            return "unexpected layer layout"
    if norm_offset(core.norm) is None:
        return f"norm {type(core.norm).__name__} is neither w * rms(x) nor (1 + w) * rms(x)"
    rotary = core.rotary_emb
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or 2 * inv_freq.numel() != head_dim:
        return "rotary embedding over part of each head (partial_rotary_factor)"
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


class NativeRunner:
    """The forward passes of the native path (a part of Engine: it reads the engine's paged cache, buffers and
    settings). One decoder implementation (`_layers`) serves prefill and decode; `self._ops` is triton_kernels or
    TorchOps. Keys and values go into the paged cache at flat indices (block * block_size + offset): prefill's come
    from the host's block tables, decode's from the device copy (`block_tables`, one row per decode row, rows that
    are not decoding all pointing at the scratch block)."""

    @staticmethod
    def _lin(x, spec, mask):
        w, b, lora = spec
        y = F.linear(x, w, b)
        if lora is not None and mask is not None:  # the delta added in place by the second matmul (no copy of y)
            y.addmm_(F.linear(x, lora[0]) * mask, lora[1].t())
        return y

    def _layers(self, x: torch.Tensor, mask, pos: torch.Tensor, kv_index: torch.Tensor, attend: Callable,
                want_kv: bool = True) -> torch.Tensor:
        """The decoder layers over token rows x [T, hidden] at positions pos [T]; each layer's keys and values go
        into the cache at kv_index [T], and attend(layer_index, q, k, v) ([T, heads, head_dim] each; k and v None
        unless want_kv) returns the attention output [T, hq * head_dim]. Returns the final-normed hidden states
        [T, hidden]."""
        nat, ops = self.nat, self._ops
        h = ops.rms_norm(x, nat.layers[0].ln1, nat.eps)
        # the row mask of the adapters' rank columns, once per part of a fused projection
        m2, m3 = (mask.repeat(1, 2), mask.repeat(1, 3)) if mask is not None else (None, None)
        n_layers = len(nat.layers)
        for li, layer in enumerate(nat.layers):
            q, k, v = ops.qkv_rope_store(self._lin(h, layer.qkv, m3), layer.q_norm, layer.k_norm, self.cos,
                                         self.sin, pos, nat.eps, kv_index, self.cache[li, 0], self.cache[li, 1],
                                         nat.hq, want_kv)
            a = attend(li, q, k, v)
            x, h = ops.rms_norm(x, layer.ln2, nat.eps, residual=self._lin(a, layer.o, mask))
            g = ops.silu_mul_rows(self._lin(h, layer.gate_up, m2))
            w_next = nat.layers[li + 1].ln1 if li + 1 < n_layers else nat.norm
            x, h = ops.rms_norm(x, w_next, nat.eps, residual=self._lin(g, layer.down, mask))
        return h

    def _gather_kv(self, li: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of the sequences whose block tables are the rows of blocks [n, nb],
        as [n, kv_heads, length, head_dim]."""
        n, nb = blocks.shape
        shape = (n, nb * self.block_size, self.nat.hkv, self.nat.head_dim)
        k = self.cache[li, 0][blocks].view(shape)[:, :length].transpose(1, 2)
        v = self.cache[li, 1][blocks].view(shape)[:, :length].transpose(1, 2)
        return k, v

    def _prefill_forward(self, ids: torch.Tensor, kv_index: torch.Tensor, rows: torch.Tensor, start: int,
                         last: torch.Tensor | None, blocks: torch.Tensor | None = None) -> torch.Tensor | None:
        """Prompt tokens ids [n, L] at positions start..start+L-1 (right-padded: causal attention keeps padding out
        of real tokens), their keys and values written at kv_index [n * L]; rows [n] are the decode rows whose
        adapters apply. start > 0 (a later chunk of one prompt) attends to the cache through blocks [1, nb].
        Returns float32 logits [n, V] at positions `last` (indices into L), or None."""
        nat = self.nat
        n, L = ids.shape
        T = n * L
        hq, hkv, d = nat.hq, nat.hkv, nat.head_dim
        positions = start + self.len_ar[:L]
        mask = self.lora_mask.index_select(0, rows).repeat_interleave(L, dim=0) if nat.lora_rank else None
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
                K, V = self._gather_kv(li, blocks, start + L)
                a = F.scaled_dot_product_attention(q4, K, V, attn_mask=attn_mask, scale=nat.scaling,
                                                   enable_gqa=hq != hkv)
            return a.transpose(1, 2).reshape(T, hq * d)

        h = self._layers(nat.embed_ids(ids.reshape(T)), mask, positions.repeat(n), kv_index, attend)
        if last is None:
            return None
        hl = h.view(n, L, -1)[torch.arange(n, device=h.device), last]
        return F.linear(hl, nat.lm_head, nat.lm_bias).float()

    def _prefill_packed(self, chunk: list[Sequence]) -> tuple[torch.Tensor, int]:
        """Whole prompts packed end to end: rows are the prompts' tokens, each at its own position, cache index and
        decode row, and attention keeps every prompt to itself. Returns float32 logits [n, V] at each prompt's last
        token, and the rows computed. With graphs, the rows are padded up to a captured size and the prefill is one
        graph replay: run eagerly it is some 450 launches, host work that bounds it (about 25 ms on an H200's
        host)."""
        T = sum(s.target for s in chunk)
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
                self.sync()
        self._prefill_packed_body(size)
        return self._pf_logits[:len(chunk)], size

    def _prefill_sizes(self) -> list[int]:
        """Row counts a packed prefill is captured for: padding to the next costs at most 1024 rows above 1024."""
        P = self.prefill_tokens
        return [b for b in [256, 512] + list(range(1024, P, 1024)) if b < P] + [P]

    def _stage_rows(self, chunk: list[Sequence], size: int) -> None:
        """Packed prefill's inputs for `chunk` into the static buffers, padded to `size` rows: padding rows are
        token 0 written into the scratch block, in pieces no longer than a prompt may be."""
        lens = [s.target for s in chunk]
        T, L, bs = sum(lens), self.max_seq_len, self.block_size
        pad = size - T
        rows = torch.empty(4, size, dtype=torch.int64)
        pad_pos = torch.arange(pad) % L
        rows[:, T:] = torch.stack([torch.zeros(pad, dtype=torch.int64), pad_pos,
                                   torch.full((pad,), self.num_slots),
                                   self.blocks.scratch_block * bs + pad_pos % bs])
        if chunk:
            rows[0, :T] = torch.tensor([t for s in chunk for t in s.ids()[:s.target]])
            rows[1, :T] = torch.cat([torch.arange(n) for n in lens])
            rows[2, :T] = torch.repeat_interleave(torch.tensor([s.slot for s in chunk]), torch.tensor(lens))
            rows[3, :T] = torch.tensor([i for s in chunk for i in self._kv_indices(s, 0, s.target)])
        pieces = lens + [L] * (pad // L) + ([pad % L] if pad % L else [])
        cu = torch.full((self._pf_seqs + 1,), size, dtype=torch.int32)
        cu[0] = 0
        cu[1:len(pieces) + 1] = torch.tensor(pieces).cumsum(0)
        if self.backend != "cpu":
            rows, cu = rows.pin_memory(), cu.pin_memory()
        self._pf_rows[:, :size].copy_(rows, non_blocking=True)
        self._pf_cu.copy_(cu, non_blocking=True)

    def _kv_indices(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache indices of positions [start, end) of seq (its blocks must cover them)."""
        table, bs = self.blocks.table(seq), self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prefill_packed_body(self, size: int) -> None:
        """Packed prefill over the first `size` staged rows: writes the KV cache, and the logits at the end of each
        of the first PREFILL_PROMPTS pieces into _pf_logits."""
        nat = self.nat
        ids, pos, row, kv_index = (self._pf_rows[i, :size] for i in range(4))
        mask = self.lora_mask.index_select(0, row) if nat.lora_rank else None
        width = nat.hq * nat.head_dim
        h = self._layers(nat.embed_ids(ids), mask, pos, kv_index,
                         lambda li, q, k, v: self._packed(q, k, v, self._pf_cu, self.max_seq_len).reshape(size, width))
        hl = h.index_select(0, self._pf_cu[1:PREFILL_PROMPTS + 1].long() - 1)
        self._pf_logits.copy_(F.linear(hl, nat.lm_head, nat.lm_bias))

    def _prefill_graph(self, size: int):
        key = ("prefill", size)
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self._prefill_packed_body(size))
        return self._graphs[key]

    def _decode_body(self, B: int, Lb: int, lora: bool = True) -> None:
        """One decode step for rows [0, B): reads ids_buf/pos_buf/block_tables, writes the KV cache, logits_buf and
        next_buf. Side effects other than those outputs are idempotent, so warm-up runs before a capture are
        harmless. The Triton kernel reads each row's own length through its block table (Lb unused); the torch
        path gathers the first Lb positions of every row's blocks and masks those past its length. lora=False: no
        row has an adapter, so the adapters' matmuls are left out."""
        nat = self.nat
        hq, hkv, d, bs = nat.hq, nat.hkv, nat.head_dim, self.block_size
        G = hq // hkv
        pos = self.pos_buf[:B].clamp(max=self.max_seq_len - 1)
        tables = self.block_tables[:B]
        kv_index = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        mask = self.lora_mask[:B] if nat.lora_rank and lora else None
        if self._tri is not None:
            lens = (pos + 1).to(torch.int32)

            def attend(li, q, k, v):
                return self._tri.paged_decode_attention(q.view(B, hkv, G, d), self.cache[li, 0], self.cache[li, 1],
                                                        tables, lens, nat.scaling).view(B, hq * d)
        else:
            nb = -(-Lb // bs)
            Lt = nb * bs
            valid = self.len_ar[:Lt][None, :] <= pos[:, None]
            addmask = torch.zeros(B, Lt, dtype=self.cache.dtype, device=self.device)
            addmask = addmask.masked_fill(~valid, float("-inf"))[:, None, None, :]

            def attend(li, q, k, v):
                K, V = self._gather_kv(li, tables[:, :nb], Lt)
                qg = q.view(B * hkv, G, d)  # the query heads of one KV head share its keys: no repeat_kv copy
                s = torch.bmm(qg, K.reshape(B * hkv, Lt, d).transpose(1, 2)).view(B, hkv, G, Lt)
                p = torch.softmax(s * nat.scaling + addmask, dim=-1, dtype=torch.float32).to(q.dtype)
                return torch.bmm(p.view(B * hkv, G, Lt), V.reshape(B * hkv, Lt, d)).reshape(B, hq * d)

        h = self._layers(nat.embed_ids(self.ids_buf[:B]), mask, pos, kv_index, attend, want_kv=False)
        out = self.logits_buf[:B]
        if nat.lm_bias is None:
            torch.mm(h, nat.lm_head.t(), out=out)
        else:
            torch.addmm(nat.lm_bias, h, nat.lm_head.t(), out=out)
        torch.argmax(out, dim=-1, out=self.next_buf[:B])

    def _graph(self, B: int, Lb: int, lora: bool = True):
        key = (B, Lb, lora)
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self._decode_body(B, Lb, lora))
        return self._graphs[key]

    def _capture(self, body: Callable[[], None]):
        t0 = time.perf_counter()
        g = graphs.capture(body, self.device, self._graph_pool)
        self.stats["graphs_captured"] += 1
        self.stats["graph_capture_seconds"] += time.perf_counter() - t0
        return g

    def _disable_triton(self, e: Exception) -> bool:
        """After a Triton kernel failed to build or capture here: keep serving with torch ops, if allowed."""
        if self._tri is None or self._want_attention == "triton":
            return False
        log.warning("engine: triton kernels failed (%s: %s); using torch ops", type(e).__name__, e)
        self._tri = None
        self._ops = TorchOps(self.nat.act)
        self._packed = None
        self._graph_prefill = False
        self.attention = "torch"
        self.stats["kernels"] = "torch"
        self.stats["kernels_error"] = f"{type(e).__name__}: {e}"
        self._graphs = {}
        self.sync()
        return True

    def _run_decode(self, B: int, Lb: int, lora: bool = True) -> None:
        """One decode step (graph replay or eager); lora=False where no row has an adapter. If the Triton kernels
        or graph capture fail on this machine and were not asked for explicitly, fall back (torch ops, then eager)
        and keep serving."""
        while True:
            try:
                if self.use_graphs:
                    self._graph(B, Lb, lora).replay()
                else:
                    self._decode_body(B, Lb, lora)
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
                    self.sync()
                    Lb = Lb or self.max_seq_len
                    continue
                raise
