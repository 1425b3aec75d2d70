"""Decode attention as one Triton kernel, for worker/engine.py on cuda and xpu.

Each program handles one (request row, KV head) pair and walks only that row's own cache length, with an online
softmax (flash-decoding without splits). The query heads that share a KV head (GQA) are packed into the rows of one
tl.dot, so each key and value is read once. Compared with the torch path (batched matmuls over a length bucket,
i.e. the longest row of the batch rounded up) this reads about half as many KV bytes when prompt lengths vary,
and the captured graph no longer depends on the length, so one graph per batch size is enough.

Import fails without triton; the engine then keeps the torch path.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(Q, K, V, O, Lens, scale,
                             s_qb, s_qh, s_qg, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_oh, s_og,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
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
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh
    for start in range(0, length, BLOCK_N):
        n = start + offs_n
        nmask = n < length
        k = tl.load(k_base + n[:, None] * s_kl + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * s_vl + offs_d[None, :], mask=nmask[:, None], other=0.0)
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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, block_n: int = 64) -> torch.Tensor:
    """q [B, Hkv, G, D] (the G query heads of each KV head); k_cache, v_cache [S >= B, Hkv, Lmax, D], row b
    attending to its first lengths[b] positions. Returns [B, Hkv, G, D] in q's dtype."""
    B, hkv, G, D = q.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    gp = max(16, triton.next_power_of_2(G))
    _decode_attention_kernel[(B, hkv)](
        q, k_cache, v_cache, out, lengths, scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        G=G, GP=gp, D=D, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out
