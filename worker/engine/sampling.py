"""Choosing each request's next token from its logits: greedy (temperature 0, argmax: the same tokens as
`generate(do_sample=False)`), or temperature + top_p, drawn with counter-based noise from (seed, token index,
vocabulary index), so a seed reproduces the same tokens whatever else shares the batch (and after a preemption).

`pick` is the one place logits become tokens, for the native and the fallback path alike: per-request logits
processing (penalties, grammars, logprobs) belongs there, on the rows of the requests that ask for it."""

from __future__ import annotations

import torch

from worker.engine import logits as logits_processing
from worker.engine.device import to_device

SAMPLE_CHUNK = 16  # rows sampled at once: bounds the [rows, vocab] temporaries of top-p and the noise
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


def _uniform(keys: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """u in (0, 1) for each (row key, vocabulary index): [rows, V] from keys [rows] and vocab [V]."""
    h = _mix32(keys[:, None] ^ vocab[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 `logits` [R, V] drawn from softmax(logits / T): argmax(logits / T + g), g the
    Gumbel noise -log(-log u) with u a hash of (the row's key, vocabulary index) (the Gumbel-max trick: no softmax
    needed). triton_kernels.gumbel_argmax is the same draw fused into one kernel."""
    out = []
    vocab = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
    for i in range(0, logits.shape[0], SAMPLE_CHUNK):
        sl = slice(i, i + SAMPLE_CHUNK)
        u = _uniform(keys[sl], vocab)
        out.append(torch.argmax(logits[sl] / temperature[sl, None] - torch.log(-torch.log(u)), dim=-1))
    return torch.cat(out)


def _nucleus(logits: torch.Tensor, temperature: torch.Tensor, top_p: list[float], keys: torch.Tensor) -> torch.Tensor:
    """The draw for rows with top_p < 1: softmax(logits / T), the least likely tokens beyond top_p of the mass
    cut, then the exponential race argmax(p / E), E = -log(u) (the same draw as gumbel_argmax's on what is left)."""
    out = []
    dev = logits.device
    vocab = torch.arange(logits.shape[-1], device=dev, dtype=torch.int64)
    for i in range(0, logits.shape[0], SAMPLE_CHUNK):
        sl = slice(i, i + SAMPLE_CHUNK)
        probs = torch.softmax(logits[sl] / temperature[sl, None], dim=-1)
        sp, idx = probs.sort(dim=-1, descending=True)
        before = sp.cumsum(dim=-1) - sp  # mass of the more likely tokens
        cut = before >= to_device(top_p[sl], torch.float32, dev)[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp.masked_fill(cut, 0.0))
        out.append(torch.argmax(probs / (-torch.log(_uniform(keys[sl], vocab))), dim=-1))
    return torch.cat(out)


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], seeds: list[int],
                  steps: list[int], draw=gumbel_argmax) -> torch.Tensor:
    """One token per row of float32 `logits` [R, V], drawn from softmax(logits / T) (top-p filtered where top_p <
    1) with noise hashed from (seed, step, vocabulary index). `draw` samples the rows without top-p
    (gumbel_argmax, or the engine's fused kernel for its device)."""
    dev = logits.device
    keys = to_device([_row_key(s, k) for s, k in zip(seeds, steps, strict=True)], torch.int64, dev)
    temps = to_device(temperature, torch.float32, dev)
    nucleus = [i for i, p in enumerate(top_p) if p < 1.0]
    if not nucleus:
        return draw(logits, temps, keys)
    if len(nucleus) == len(top_p):
        return _nucleus(logits, temps, top_p, keys)
    # some rows of each kind: each drawn once, by its own path
    plain = to_device([i for i, p in enumerate(top_p) if p >= 1.0], torch.int64, dev)
    cut = to_device(nucleus, torch.int64, dev)
    toks = torch.empty(len(top_p), dtype=torch.int64, device=dev)
    toks.index_copy_(0, plain, draw(logits.index_select(0, plain), temps.index_select(0, plain),
                                    keys.index_select(0, plain)))
    toks.index_copy_(0, cut, _nucleus(logits.index_select(0, cut), temps.index_select(0, cut),
                                      [top_p[i] for i in nucleus], keys.index_select(0, cut)))
    return toks


def pick(logits: torch.Tensor, greedy: torch.Tensor | None, rows: list, steps: list[int],
         draw=gumbel_argmax) -> torch.Tensor:
    """Tokens for the rows of `logits` ([N, V]). `rows` pairs a row index with its sequence (which has
    temperature, top_p and seed); `steps` gives each one's output index. Rows with temperature > 0 are sampled
    (by `draw`, see sample_tokens), the others take `greedy` (argmax of logits when None). Rows whose requests ask
    for logits processing get it first (worker/engine/logits.py, which also keeps their logprobs)."""
    if all(s.temperature == 0 and s.logits is None for _, s in rows):  # the common case, in one pass over the rows
        return torch.argmax(logits, dim=-1) if greedy is None else greedy
    greedy = logits_processing.process(logits, rows, greedy)
    toks = torch.argmax(logits, dim=-1) if greedy is None else greedy
    samp = [(i, s, k) for (i, s), k in zip(rows, steps, strict=True) if s.temperature > 0]
    if samp:
        index = to_device([i for i, _, _ in samp], torch.int64, logits.device)
        drawn = sample_tokens(logits.index_select(0, index).float(), [s.temperature for _, s, _ in samp],
                              [s.top_p for _, s, _ in samp], [s.seed for _, s, _ in samp], [k for _, _, k in samp],
                              draw)
        toks = toks.clone() if greedy is None else toks
        toks.index_copy_(0, index, drawn)
    logits_processing.record(logits, toks, rows)
    return toks
