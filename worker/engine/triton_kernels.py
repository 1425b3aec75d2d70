"""Decode attention over the paged KV cache as one Triton kernel, for the engine (model_runner.py) on cuda and xpu.

Each program handles one (request row, KV head) pair and walks only that row's own cache length through its block
table (the blocks its positions live in), with an online softmax (flash-decoding without splits). The query heads
that share a KV head (GQA) are packed into the rows of one tl.dot, so each key and value is read once. Compared
with the torch path (gathering every row's blocks up to a length bucket, i.e. the longest row of the batch rounded
up) this reads about half as many KV bytes when prompt lengths vary, and the captured graph no longer depends on
the length, so one graph per batch size is enough.

Import fails without triton; the engine then keeps the torch path.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(Q, K, V, O, Lens, Tables, scale,
                         s_qb, s_qh, s_qg, s_kblk, s_kl, s_kh, s_vblk, s_vl, s_vh, s_ob, s_oh, s_og, s_tb,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(Lens + b)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    q = tl.load(Q + b * s_qb + h * s_qh + offs_g[:, None] * s_qg + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    table = Tables + b * s_tb
    for start in range(0, length, BLOCK_N):
        n = start + offs_n
        nmask = n < length
        # position n lives at offset n % BS of block table[n // BS]
        blk = tl.load(table + n // BS, mask=nmask, other=0).to(tl.int64)
        off = n % BS
        k = tl.load(K + blk[:, None] * s_kblk + off[:, None] * s_kl + h * s_kh + offs_d[None, :],
                    mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + blk[:, None] * s_vblk + off[:, None] * s_vl + h * s_vh + offs_d[None, :],
                    mask=nmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + b * s_ob + h * s_oh + offs_g[:, None] * s_og + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=gmask[:, None])


def supported(head_dim: int, groups: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and groups <= 64


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block_n: int = 64, num_warps: int = 4,
                           num_stages: int = 2) -> torch.Tensor:
    """q [B, Hkv, G, D] (the G query heads of each KV head); k_cache, v_cache [blocks, block_size, Hkv, D];
    tables [>= B, max_blocks] the block table of each row, row b attending to its first lengths[b] positions.
    Returns [B, Hkv, G, D] in q's dtype."""
    B, hkv, G, D = q.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    gp = max(16, triton.next_power_of_2(G))
    _paged_decode_kernel[(B, hkv)](
        q, k_cache, v_cache, out, lengths, tables, scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tables.stride(0), G=G, GP=gp, D=D, BS=k_cache.shape[1], BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    return out


# ------------------------------------------------------------------------------------------- fused elementwise
# The decode step of a small model is hundreds of tiny kernels; inside a graph each still costs a few microseconds.
# These fuse the chains transformers runs as separate ops (RMSNorm is ~7 kernels, q/k norm + RoPE ~12) and keep
# its rounding: every intermediate that transformers stores in the model dtype is rounded to it here as well.


@triton.jit
def _rms_kernel(X, R, W, Y, XO, s_x, s_r, s_y, s_xo, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(X + row * s_x + cols, mask=m, other=0.0)
    if HAS_RES:  # x = x + r (transformers: residual + hidden_states, rounded to the model dtype)
        r = tl.load(R + row * s_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(XO.dtype.element_ty)
        tl.store(XO + row * s_xo + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=m, other=0.0)
    tl.store(Y + row * s_y + cols, (y.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """transformers' RMSNorm over the last dim of x [..., N]; with `residual`, first x = x + residual and
    returns (x, norm(x))."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    if residual is None:
        _rms_kernel[(x2.shape[0],)](x2, x2, w, y, y, x2.stride(0), 0, y.stride(0), 0, n, eps, HAS_RES=False,
                                    BLOCK=block, num_warps=warps)
        return y.view(shape)
    r2 = residual.reshape(-1, n)
    xo = torch.empty_like(x2)
    _rms_kernel[(x2.shape[0],)](x2, r2, w, y, xo, x2.stride(0), r2.stride(0), y.stride(0), xo.stride(0), n, eps,
                                HAS_RES=True, BLOCK=block, num_warps=warps)
    return xo.view(shape), y.view(shape)


@triton.jit
def _head_norm_weight(W, c, HALF: tl.constexpr, HAS: tl.constexpr):
    """A per-head norm's weight as its two halves (float32), or ones where the model has no such norm."""
    if HAS:
        w1 = tl.load(W + c).to(tl.float32)
        w2 = tl.load(W + HALF + c).to(tl.float32)
    else:
        w1 = tl.full([1, HALF], 1.0, tl.float32)
        w2 = w1
    return w1, w2


@triton.jit
def _store_head(dst, c, HALF: tl.constexpr, a, b, mask):
    """The heads' two halves a, b at dst (one head a row), where mask holds."""
    tl.store(dst + c, a, mask=mask)
    tl.store(dst + HALF + c, b, mask=mask)


@triton.jit
def _qkv_kernel(QKV, QW, KW, COS, SIN, POS, IDX, QO, KO, VO, KC, VC, s_t, s_c, s_qo, s_ko, s_kc, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, NHP: tl.constexpr, HALF: tl.constexpr, HAS_QN: tl.constexpr,
                HAS_KN: tl.constexpr, WANT_KV: tl.constexpr):
    """One program per token of a fused qkv row, its heads as the rows of one tile: q heads are normed (Qwen3's
    q_norm) and rotated into QO, k heads normed, rotated and written into the cache at the token's flat index, v
    heads copied there; with WANT_KV k and v also go to KO / VO (prefill's attention reads them). Every
    intermediate transformers stores in the model dtype is rounded to it here too."""
    t = tl.program_id(0)
    h = tl.arange(0, NHP)[:, None]
    c = tl.arange(0, HALF)[None, :]
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HKV)
    is_v = (h >= HQ + HKV) & (h < HQ + 2 * HKV)
    row = QKV + t * s_t + h * (2 * HALF)
    x1 = tl.load(row + c, mask=h < HQ + 2 * HKV, other=0.0)
    x2 = tl.load(row + HALF + c, mask=h < HQ + 2 * HKV, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_QN or HAS_KN:
        r = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1))[:, None] / (2 * HALF) + eps)
        qw1, qw2 = _head_norm_weight(QW, c, HALF, HAS_QN)
        kw1, kw2 = _head_norm_weight(KW, c, HALF, HAS_KN)
        n1 = ((f1 * r).to(dt).to(tl.float32) * tl.where(is_q, qw1, kw1)).to(dt).to(tl.float32)
        n2 = ((f2 * r).to(dt).to(tl.float32) * tl.where(is_q, qw2, kw2)).to(dt).to(tl.float32)
        normed = (is_q & HAS_QN) | (is_k & HAS_KN)
        f1 = tl.where(normed, n1, f1)
        f2 = tl.where(normed, n2, f2)
    p = tl.load(POS + t)
    cos1 = tl.load(COS + p * s_c + c).to(tl.float32)
    cos2 = tl.load(COS + p * s_c + HALF + c).to(tl.float32)
    sin1 = tl.load(SIN + p * s_c + c).to(tl.float32)
    sin2 = tl.load(SIN + p * s_c + HALF + c).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
    o1 = ((f1 * cos1).to(dt).to(tl.float32) + (-f2 * sin1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * cos2).to(dt).to(tl.float32) + (f1 * sin2).to(dt).to(tl.float32)).to(dt)
    _store_head(QO + t * s_qo + h * (2 * HALF), c, HALF, o1, o2, is_q)
    slot = tl.load(IDX + t).to(tl.int64)
    _store_head(KC + slot * s_kc + (h - HQ) * (2 * HALF), c, HALF, o1, o2, is_k)
    _store_head(VC + slot * s_kc + (h - HQ - HKV) * (2 * HALF), c, HALF, x1, x2, is_v)
    if WANT_KV:
        _store_head(KO + t * s_ko + (h - HQ) * (2 * HALF), c, HALF, o1, o2, is_k)
        _store_head(VO + t * s_ko + (h - HQ - HKV) * (2 * HALF), c, HALF, x1, x2, is_v)


def qkv_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, pos: torch.Tensor, eps: float, kv_index: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, hq: int, want_kv: bool):
    """A fused projection's rows qkv [T, (hq + 2 hkv) * D] -> q [T, hq, D] normed (when q_norm is given) and
    rotated at positions pos [T]; k (likewise) and v written into k_cache / v_cache [blocks, block_size, hkv, D] at
    flat indices kv_index [T]. Returns (q, k, v), k and v [T, hkv, D] only when want_kv (else None): one launch for
    what transformers does in some 20 ops and the engine's cache writes in two more."""
    T = qkv.shape[0]
    _, _, hkv, D = k_cache.shape
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty(T, hq, D, dtype=qkv.dtype, device=qkv.device)
    k = v = None
    if want_kv:
        k = torch.empty(T, hkv, D, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
    _qkv_kernel[(T,)](
        qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, cos, sin, pos, kv_index,
        q, k if want_kv else q, v if want_kv else q, k_cache, v_cache, qkv.stride(0), cos.stride(0), q.stride(0),
        hkv * D, hkv * D, eps, HQ=hq, HKV=hkv, NHP=triton.next_power_of_2(hq + 2 * hkv), HALF=D // 2,
        HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, WANT_KV=want_kv, num_warps=4)
    return q, k, v


@triton.jit
def _silu_mul_kernel(GU, O, s_g, s_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(GU + row * s_g + offs, mask=m, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(dt).to(tl.float32)
    u = tl.load(GU + row * s_g + n + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(O + row * s_o + offs, (s * u).to(dt), mask=m)


def silu_mul_rows(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2N], a fused gate_up projection's rows -> silu(gate) * up [T, N], rounded to the model dtype as
    transformers does (act_fn(gate) * up)."""
    T, n = gu.shape[0], gu.shape[1] // 2
    assert gu.stride(-1) == 1
    out = torch.empty(T, n, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(T, triton.cdiv(n, 1024))](gu, out, gu.stride(0), out.stride(0), n, BLOCK=1024, num_warps=4)
    return out


# Sampling (sampling.py's Gumbel-max draw, fused): each program scores one block of one row's vocabulary,
# logits / T - log(-log u) with u hashed from (row key, token id) as sampling.py hashes it, and keeps its best; the
# torch ops it replaces pass over [rows, vocab] some 25 times (the int64 hash above all).
SAMPLE_BLOCK = 4096


@triton.jit
def _mix32(x):  # sampling._mix32: x in [0, 2**32) as int64; products wrap mod 2**64, their low 32 bits are exact
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_kernel(L, s_l, T, K, S, I, n, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    logit = tl.load(L + row * s_l + offs, mask=m, other=float("-inf")).to(tl.float32)
    h = _mix32(tl.load(K + row) ^ offs.to(tl.int64))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    score = tl.where(m, logit / tl.load(T + row) - tl.log(-tl.log(u)), float("-inf"))
    best = tl.argmax(score, 0)
    tl.store(S + row * tl.num_programs(1) + blk, tl.max(score, 0))
    tl.store(I + row * tl.num_programs(1) + blk, blk * BLOCK + best)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sampling.gumbel_argmax on the device: logits [R, V] float32, temperature [R] float32, keys [R] int64."""
    R, V = logits.shape
    assert logits.stride(-1) == 1
    blocks = triton.cdiv(V, SAMPLE_BLOCK)
    scores = torch.empty(R, blocks, dtype=torch.float32, device=logits.device)
    index = torch.empty(R, blocks, dtype=torch.int64, device=logits.device)
    _gumbel_kernel[(R, blocks)](logits, logits.stride(0), temperature, keys, scores, index, V, BLOCK=SAMPLE_BLOCK,
                                num_warps=8)
    return index.gather(1, scores.argmax(1, keepdim=True))[:, 0]


def fused_supported(head_dim: int, hidden_act: str) -> bool:
    return head_dim >= 4 and (head_dim // 2) & (head_dim // 2 - 1) == 0 and hidden_act in ("silu", "swish")
