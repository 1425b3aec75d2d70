"""The fallback path: any causal LM the native decoder does not cover (other architectures, quantized or
multi-device bases, adapters other than plain LoRA), run through the model's own forward with a DynamicCache.

Why it is shaped this way: the model's own forward costs tens of milliseconds of host time per step whatever the
batch, so throughput is rows per step. Every request therefore joins one running batch: new requests are prefilled
(left padded, in pieces of at most prefill_tokens, launched back to back) and their caches merged into the running
one at once, left padded to a common width; finished rows are dropped (and the columns no row uses any more) once an
eighth of the rows are done or the batch holds max_batch_size rows. Positions and the attention mask are per row, so
padding never changes a row's tokens. The host reads step k's tokens while the device computes step k+1 (not for a
batch holding a grammar-constrained request: its next mask needs the token just drawn). Caches whose layers are not
plain full-attention DynamicLayers (sliding windows, linear attention) cannot be merged: such a model runs its
prefilled pieces side by side instead. PEFT's mixed-batch `adapter_names=[...]` selects adapters per row.

Interface with the engine (engine.py), which owns the request queue, the thread and the results:
  FallbackPath(engine)  once per model setup; reads engine.model/.base/.device/.budget/.prefill_tokens/
                        .max_batch_size/.kv_bytes_per_token/.vocab_size and writes into engine.stats
  step()                one iteration: cancels, one decode step per batch (reading the step before's tokens),
                        dropping finished rows, admission
  has_work()            whether requests are running here
  fail_all(error)       finish every running request with an error
Requests are finished through engine.accept (a new token) and engine.finish; tokens come from sampling.pick.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker.engine.device import HostTokens
from worker.engine.sampling import pick

if TYPE_CHECKING:
    from worker.engine.engine import Engine, Sequence

log = logging.getLogger(__name__)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - x.shape[dim]
    if extra == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [extra, 0])


def _mergeable(cache) -> bool:
    """Every layer a plain full-attention DynamicLayer: the rows of two such caches can be concatenated."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)


class _Batch:
    """Requests decoding together: one cache, rows left padded to one width."""

    def __init__(self, seqs: list[Sequence], cache, mask: torch.Tensor, pos: torch.Tensor, nxt: torch.Tensor,
                 adapters: list[str] | None):
        self.seqs = seqs
        self.cache = cache
        self.mask = mask  # [rows, width], 0 on left padding
        self.pos = pos  # [rows]: position of each row's last token
        self.next = nxt  # [rows]: each row's next input token, on the device
        self.adapters = adapters
        self.mergeable = _mergeable(cache)
        self.pending: HostTokens | None = None  # the last step's tokens, read on the next iteration

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def live(self) -> int:
        return sum(not s.finished for s in self.seqs)

    def merge(self, others: list[_Batch]) -> None:
        """Append the rows of `others` (one copy of each cache, however many join)."""
        parts = [self, *others]
        w = max(p.width for p in parts)
        for li, layer in enumerate(self.cache.layers):
            layer.keys = torch.cat([_pad_left(p.cache.layers[li].keys, w, -2) for p in parts])
            layer.values = torch.cat([_pad_left(p.cache.layers[li].values, w, -2) for p in parts])
        self.mask = torch.cat([_pad_left(p.mask, w, -1) for p in parts])
        self.pos = torch.cat([p.pos for p in parts])
        self.next = torch.cat([p.next for p in parts])
        self.seqs = [s for p in parts for s in p.seqs]
        if self.adapters is not None:
            self.adapters = [a for p in parts for a in p.adapters]

    def compact(self) -> None:
        """Drop the finished rows, and the left columns no remaining row uses."""
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        idx = torch.tensor(keep, dtype=torch.int64, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        first = int(self.mask.any(0).int().argmax())
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:  # layers may sit on several devices (device_map="auto")
            rows = idx.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, rows)[:, :, first:]
            layer.values = layer.values.index_select(0, rows)[:, :, first:]
        self.pos = self.pos.index_select(0, idx)
        self.next = self.next.index_select(0, idx)
        self.seqs = [self.seqs[i] for i in keep]
        if self.adapters is not None:
            self.adapters = [self.adapters[i] for i in keep]


class FallbackPath:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._batches: list[_Batch] = []
        params = inspect.signature(engine.base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        cfg = engine.base.config
        el = next(engine.model.parameters()).element_size()
        wide = max(cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
        ws = engine.prefill_tokens * wide * el * 12 + 64 * engine.vocab_size * 12
        self._kv_budget = engine.budget - ws
        if self._kv_budget < engine.kv_bytes_per_token * 16:
            raise ValueError(f"memory_budget_bytes={engine.budget} leaves no room for a KV cache after the "
                             f"{ws}-byte workspace")
        engine.stats.update(num_slots=engine.max_batch_size, max_seq_len=engine.max_seq_len,
                            budget_bytes=engine.budget, kv_cache_bytes=0, workspace_estimate_bytes=ws)
        # the engine's peak memory counts from here (on a GPU, the engine thread reads it after every step)
        engine._reset_peak()
        engine._mem_base = engine._allocated()

    def has_work(self) -> bool:
        return bool(self._batches)

    def fail_all(self, error: str) -> None:
        for b in self._batches:
            for seq in b.seqs:
                self.engine.finish(seq, "error", error)
        self._batches = []

    def _forward(self, cache, **kw):
        kw[self._cache_kwarg] = cache
        return self.engine.model(use_cache=True, return_dict=True, logits_to_keep=1, **kw).logits[:, -1, :]

    def step(self) -> None:
        eng = self.engine
        cancels = eng.take_cancels()
        for b in self._batches:
            for seq in b.seqs:
                if seq.req.request_id in cancels:
                    eng.finish(seq, "cancelled")
        for b in self._batches:
            self._decode(b)
        for b in list(self._batches):
            done = len(b.seqs) - b.live()
            if done == len(b.seqs) and b.pending is None:
                self._batches.remove(b)
            elif done and (8 * done >= len(b.seqs) or len(b.seqs) >= eng.max_batch_size):
                b.compact()
        self._admit()

    def _accept(self, out: HostTokens) -> None:
        host = out.tokens()
        for i, seq in out.rows:
            self.engine.accept(seq, host[i])

    def _admit(self) -> None:
        """Waiting requests join while rows and the KV budget allow: the budget bounds rows x (width + the longest
        output still to come), what the merged cache may grow to."""
        eng = self.engine
        room = eng.max_batch_size - sum(b.live() for b in self._batches)
        if room <= 0:
            return
        cands = eng.pop_waiting(room)
        budget = self._kv_budget // eng.kv_bytes_per_token
        rows = sum(len(b.seqs) for b in self._batches)
        width = max((b.width for b in self._batches), default=0)
        reach = max((s.limit - s.n_launched for b in self._batches for s in b.seqs if not s.finished), default=0)
        chunk: list[Sequence] = []
        settled = set()
        for s in sorted(cands, key=lambda s: s.prompt_len):
            if s.prompt_len + s.limit > budget:
                eng.finish(s, "error", f"the prompt plus max_new_tokens needs "
                                       f"{(s.prompt_len + s.limit) * eng.kv_bytes_per_token} bytes of KV cache, "
                                       f"more than the memory budget allows ({self._kv_budget})")
                settled.add(id(s))
                continue
            w, r = max(width, s.prompt_len), max(reach, s.limit)
            if (rows + 1) * (w + r) > budget:
                break
            rows, width, reach = rows + 1, w, r
            chunk.append(s)
            settled.add(id(s))
        eng.push_back([s for s in cands if id(s) not in settled and not s.finished])
        if not chunk:
            return
        t0 = time.perf_counter()
        fresh: list[_Batch] = []
        i = 0
        while i < len(chunk):  # pieces of at most prefill_tokens padded tokens (sorted, so the last is the longest)
            j = i + 1
            while j < len(chunk) and (j + 1 - i) * chunk[j].prompt_len <= eng.prefill_tokens:
                j += 1
            piece, i = chunk[i:j], j
            try:
                fresh.append(self._prefill(piece))
            except Exception as e:
                log.exception("prefill failed")
                for seq in piece:
                    eng.finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
        # the pieces were launched one after another; their first tokens are read once, then they join together
        for b in fresh:
            self._accept(b.pending)
            b.pending = None
        fresh = [b for b in fresh if b.live()]
        joining = [b for b in fresh if b.mergeable]
        self._batches += [b for b in fresh if not b.mergeable]
        if joining:
            into = next((b for b in self._batches if b.mergeable
                         and (b.adapters is None) == (joining[0].adapters is None)), None)
            if into is None:
                into = joining.pop(0)
                self._batches.append(into)
            if joining:
                into.merge(joining)
        eng.stats["prefill_seconds"] += time.perf_counter() - t0

    def _prefill(self, chunk: list[Sequence]) -> _Batch:
        """The prompts of `chunk` through the model, as a batch of their own whose first tokens are in flight."""
        from transformers import DynamicCache

        eng = self.engine
        n = len(chunk)
        L = max(s.prompt_len for s in chunk)
        pad = getattr(eng.base.config, "pad_token_id", None)
        pad = 0 if pad is None else pad
        ids = torch.full((n, L), pad, dtype=torch.int64)
        mask = torch.zeros(n, L, dtype=torch.int64)
        for i, s in enumerate(chunk):  # left padding
            ids[i, L - s.prompt_len:] = torch.tensor(s.req.prompt_ids)
            mask[i, L - s.prompt_len:] = 1
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = None
        if eng.is_peft:
            adapters = [s.req.adapter if s.req.adapter is not None else "__base__" for s in chunk]
        cache = DynamicCache(config=eng.base.config)
        kw = {"adapter_names": adapters} if adapters is not None else {}
        logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, **kw)
        rows = list(enumerate(chunk))
        toks = pick(logits, None, rows, [0] * n)
        batch = _Batch(list(chunk), cache, mask, pos[:, -1], toks, adapters)
        batch.pending = HostTokens(toks, rows, eng.backend)
        for seq in chunk:
            seq.n_launched = 1
        eng.stats["prefill_calls"] += 1
        eng.stats["prefill_tokens"] += sum(s.prompt_len for s in chunk)
        eng.stats["prefill_padded_tokens"] += n * L
        return batch

    def _decode(self, b: _Batch) -> None:
        """Launch one decode step for batch `b` if a row still needs a token, then read the previous step's tokens
        while the device computes this one (a row that ended with them computed one token for nothing). A grammar's
        mask needs the token drawn just before, so a batch with a constrained row reads them before it picks."""
        old, b.pending = b.pending, None
        if not any(not s.finished and s.n_launched < s.limit for s in b.seqs):
            if old is not None:
                self._accept(old)
            return
        eng = self.engine
        t0 = time.perf_counter()
        b.mask = torch.cat([b.mask, b.mask.new_ones(b.mask.shape[0], 1)], dim=1)
        b.pos = b.pos + 1
        kw = {}
        if eng.is_peft:  # rows prefilled before the base was wrapped run on as base rows
            kw["adapter_names"] = b.adapters or ["__base__"] * len(b.seqs)
        logits = self._forward(input_ids=b.next[:, None], attention_mask=b.mask, position_ids=b.pos[:, None],
                               cache=b.cache, **kw)
        if old is not None and any(s.logits is not None and s.logits.constrained for s in b.seqs):
            self._accept(old)
            old = None
        rows = list(enumerate(b.seqs))
        b.next = pick(logits, None, rows, [s.n_launched for s in b.seqs])
        for s in b.seqs:
            s.n_launched += 1
        b.pending = HostTokens(b.next, [(i, s) for i, s in rows if not s.finished], eng.backend)
        if old is not None:
            self._accept(old)
        live = b.live()
        eng.stats["decode_steps"] += 1
        eng.stats["decode_rows"] += live
        eng.stats["max_running"] = max(eng.stats["max_running"], live)
        eng.stats["decode_seconds"] += time.perf_counter() - t0
