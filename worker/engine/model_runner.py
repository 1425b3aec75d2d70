"""The native path's model runner: the decoder of Llama-style models (llama, mistral, qwen2, qwen3, phi3, gemma)
written here against the model's own weight tensors, writing and reading the engine's KV cache. One decoder covers
the families: Phi-3's fused qkv_proj / gate_up_proj are read as row views of their weights; Gemma's (1 + w) norms
are folded into the norm weights once, its embedding scale multiplies the embedded tokens, and the MLP calls the
model's own activation (GELU for Gemma; the fused Triton kernels cover SiLU only, so other activations run on
torch ops).

On cuda/xpu with triton (kernels="auto"/"triton"), triton_kernels.py supplies decode attention that reads only each
row's own cache length and fused RMSNorm / q-k norm + RoPE / SiLU*up kernels, and prefill packs prompts end to end
(torch's flash kernel, no padding between prompts); on cpu (and with kernels="torch") plain torch ops reproduce
transformers' arithmetic exactly. LoRA adapters (PEFT) are applied per row inside one batch: every adapter's A and
B matrices are stacked per projection and a per-row mask selects the adapter's rank columns, i.e.
delta = ((x @ A_all^T) * mask) @ (scaling * B_all)^T.
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


def _split_rows(linear, sizes: list[int]) -> list[tuple]:
    """Row views of a fused projection's weight (and bias), one per part: q, k, v or gate, up."""
    w, b = linear.weight, linear.bias
    ws, bs = w.split(sizes), (b.split(sizes) if b is not None else [None] * len(sizes))
    return [(wi, bi, None) for wi, bi in zip(ws, bs)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
    __slots__ = ("ln1", "ln2", "q_norm", "k_norm", "lin")


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
            L.lin = {}
            if hasattr(att, "qkv_proj"):  # Phi-3: fused projections (LoRA on them takes the fallback path)
                q, kv = self.hq * self.head_dim, self.hkv * self.head_dim
                parts = _split_rows(getattr(att.qkv_proj, "base_layer", att.qkv_proj), [q, kv, kv])
                L.lin.update(zip(("q_proj", "k_proj", "v_proj"), parts))
            if hasattr(mlp, "gate_up_proj"):
                parts = _split_rows(getattr(mlp.gate_up_proj, "base_layer", mlp.gate_up_proj), [self.intermediate] * 2)
                L.lin.update(zip(("gate_proj", "up_proj"), parts))
            for pname in _PROJECTIONS:
                if pname in L.lin:
                    continue
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
    """The forward passes of the native path (a part of Engine: it reads the engine's cache, buffers and
    settings). Prefill writes prompts' keys and values into the cache and returns the last positions' logits;
    a decode step reads ids_buf/pos_buf and writes logits_buf/next_buf, as a graph replay where graphs run."""

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
        x = nat.embed_ids(ids)
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
        x = nat.embed_ids(ids.reshape(T))
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

    def _prefill_packed(self, chunk: list[Sequence]) -> tuple[torch.Tensor, int]:
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
                self.sync()
        self._prefill_packed_body(size)
        return self._pf_logits[:len(chunk)], size

    def _prefill_sizes(self) -> list[int]:
        """Row counts a packed prefill is captured for: padding to the next costs at most 1024 rows above 1024."""
        P = self.prefill_tokens
        return [b for b in [256, 512] + list(range(1024, P, 1024)) if b < P] + [P]

    def _stage_rows(self, chunk: list[Sequence], size: int) -> None:
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
        of the first PREFILL_PROMPTS pieces into _pf_logits."""
        nat = self.nat
        ids, pos, slot = self._pf_rows[0, :size], self._pf_rows[1, :size], self._pf_rows[2, :size]
        idx = ((slot[:, None] * nat.hkv + self.head_ar[None, :]) * self.max_seq_len + pos[:, None]).reshape(-1)
        mask = self.lora_mask.index_select(0, slot) if nat.lora_rank else None
        width = nat.hq * nat.head_dim
        x = self._fused_layers(nat.embed_ids(ids), mask, pos, idx,
                               lambda li, q, k, v: self._packed(q, k, v, self._pf_cu,
                                                                self.max_seq_len).reshape(size, width))
        xl = x.index_select(0, self._pf_cu[1:PREFILL_PROMPTS + 1].long() - 1)
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
        x = nat.embed_ids(self.ids_buf[:B])
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
        x = nat.embed_ids(self.ids_buf[:B])
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
        self._packed = None
        self._graph_prefill = False
        self.attention = "torch"
        self.stats["kernels"] = "torch"
        self.stats["kernels_error"] = f"{type(e).__name__}: {e}"
        self._graphs = {}
        self.sync()
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
                    self.sync()
                    Lb = Lb or self.max_seq_len
                    continue
                raise

