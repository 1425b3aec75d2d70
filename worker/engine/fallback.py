"""The fallback path: any causal LM the native decoder does not cover (other architectures, quantized or
multi-device bases, adapters other than plain LoRA), run through the model's own forward with a DynamicCache.

Why it is shaped this way: the model's own forward costs tens of milliseconds of host time per step whatever the
batch, so throughput is rows per step. Every request therefore joins one running batch: new requests are prefilled
(left padded, in pieces of at most prefill_tokens, launched back to back) and their caches merged into the running
one at once, left padded to a common width, in buffers with room for every column its rows may still take: a decode
step writes its column in place, where a DynamicLayer copies its whole cache every step (torch.cat: most of a 256-row
decode step's time on cpu, docs/results/cpu-fallback-profile.md); the attention mask likewise. Finished rows are dropped
(and the columns no row uses any more) once an eighth of the rows are done or the batch holds max_batch_size rows.
Positions and the attention mask are per row, so padding never changes a row's tokens. The host reads step k's
tokens while the device computes step k+1 (not for a batch holding a grammar-constrained request: its next mask
needs the token just drawn). Caches whose layers are not plain full-attention DynamicLayers (sliding windows, linear
attention) cannot be merged: such a model runs its prefilled pieces side by side instead. PEFT's mixed-batch
`adapter_names=[...]` selects adapters per row.

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

import functools
import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch

from worker.engine.device import HostTokens
from worker.engine.sampling import pick

if TYPE_CHECKING:
    from worker.engine.engine import Engine, Sequence

log = logging.getLogger(__name__)


def _mergeable(cache) -> bool:
    """Every layer a plain full-attention DynamicLayer: the rows of two such caches can be concatenated."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    plain = (DynamicLayer, _roomy_layer())
    return bool(layers) and all(type(layer) in plain and layer.keys is not None for layer in layers)


def _stack_right(parts: list[torch.Tensor], width: int, room: int) -> torch.Tensor:
    """`parts` ([rows, ..., columns(, d)] along dim 2 for caches, dim 1 for masks) stacked by rows into a buffer of
    width + room columns, each part right-aligned to `width` with zeros on its left (masked padding must hold
    finite values: a zero attention weight times a stale NaN is NaN); the room is left unwritten."""
    dim = 2 if parts[0].dim() == 4 else 1
    first = parts[0]
    shape = list(first.shape)
    shape[0] = sum(p.shape[0] for p in parts)
    shape[dim] = width + room
    buf = first.new_empty(shape)
    r = 0
    for p in parts:
        rows, cols = buf.narrow(0, r, p.shape[0]), p.shape[dim]
        rows.narrow(dim, 0, width - cols).zero_()
        rows.narrow(dim, width - cols, cols).copy_(p)
        r += p.shape[0]
    return buf


@functools.cache
def _roomy_layer() -> type:
    """The class of a merged cache's layers (transformers is imported where a fallback model runs)."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A full-attention layer whose keys and values are views into buffers with room for the columns still to
        come: a decode step writes its column in place, where DynamicLayer copies the whole cache (torch.cat)."""

        def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, width: int):
            super().__init__()
            self.device = k_buf.device
            self.is_initialized = True
            self.k_buf, self.v_buf = k_buf, v_buf
            self.keys, self.values = k_buf[:, :, :width], v_buf[:, :, :width]

        def update(self, key_states, value_states, *args, **kwargs):
            # the room is what the batch's rows may still launch (_Batch.room), so a step always fits
            w, n = self.keys.shape[-2], key_states.shape[-2]
            self.k_buf[:, :, w:w + n].copy_(key_states)
            self.v_buf[:, :, w:w + n].copy_(value_states)
            self.keys, self.values = self.k_buf[:, :, :w + n], self.v_buf[:, :, :w + n]
            return self.keys, self.values

    return RoomyLayer


class _Batch:
    """Requests decoding together: one cache, rows left padded to one width. The mask (and a merged cache) sit in
    buffers with room for the columns the rows may still take, so a decode step appends without copying."""

    def __init__(self, seqs: list[Sequence], cache, mask: torch.Tensor, pos: torch.Tensor, nxt: torch.Tensor,
                 adapters: list[str] | None):
        self.seqs = seqs
        self.cache = cache
        self._mask = mask  # [rows, width + room], 0 on left padding, 1 in the room
        self.width = mask.shape[1]
        self.pos = pos  # [rows]: position of each row's last token
        self.next = nxt  # [rows]: each row's next input token, on the device
        self.adapters = adapters
        self.mergeable = _mergeable(cache)
        self.pending: HostTokens | None = None  # the last step's tokens, read on the next iteration

    @property
    def mask(self) -> torch.Tensor:
        return self._mask[:, :self.width]

    def live(self) -> int:
        return sum(not s.finished for s in self.seqs)

    def room(self) -> int:
        """Columns the decode steps may still add: the most tokens a live row has still to launch."""
        return max((s.limit - s.n_launched for s in self.seqs if not s.finished), default=0)

    def grow(self) -> None:
        """One column more for the step being launched (every row's mask 1 there)."""
        if self.width == self._mask.shape[1]:
            self._mask = _stack_right([self.mask], self.width, max(1, self.room()))
            self._mask[:, self.width:] = 1
        self.width += 1

    def _rebuild(self, parts: list[_Batch], width: int, keep: torch.Tensor | None = None) -> None:
        """The rows of `parts` (only those in `keep`, for a single part), right-aligned to `width`, in fresh buffers
        with room for the columns still to come."""
        room = max(p.room() for p in parts)
        if self.mergeable:
            for li in range(len(self.cache.layers)):  # layers may sit on several devices (device_map="auto")
                ks = [p.cache.layers[li].keys for p in parts]
                vs = [p.cache.layers[li].values for p in parts]
                if keep is not None:
                    rows = keep.to(ks[0].device)
                    ks, vs = [ks[0].index_select(0, rows)[:, :, -width:]], [vs[0].index_select(0, rows)[:, :, -width:]]
                k_buf = _stack_right(ks, width, room)
                v_buf = _stack_right(vs, width, room)
                self.cache.layers[li] = _roomy_layer()(k_buf, v_buf, width)
        masks = [p.mask for p in parts]
        if keep is not None:
            masks = [masks[0].index_select(0, keep)[:, -width:]]
        self._mask = _stack_right(masks, width, room)
        self._mask[:, width:] = 1
        self.width = width

    def merge(self, others: list[_Batch]) -> None:
        """Append the rows of `others` (one copy of each cache, however many join; none: just make room)."""
        parts = [self, *others]
        self._rebuild(parts, max(p.width for p in parts))
        self.pos = torch.cat([p.pos for p in parts])
        self.next = torch.cat([p.next for p in parts])
        self.seqs = [s for p in parts for s in p.seqs]
        if self.adapters is not None:
            self.adapters = [a for p in parts for a in p.adapters]

    def compact(self) -> None:
        """Drop the finished rows, and the left columns no remaining row uses."""
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        idx = torch.tensor(keep, dtype=torch.int64, device=self.pos.device)
        if self.mergeable:
            first = int(self.mask.index_select(0, idx).any(0).int().argmax())
            self._rebuild([self], self.width - first, keep=idx)
        else:
            mask = self.mask.index_select(0, idx)
            first = int(mask.any(0).int().argmax())
            self._mask, self.width = mask[:, first:], self.width - first
            for layer in self.cache.layers:
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
        if cancels:
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
        for s in sorted(cands, key=lambda s: (s.req.priority, s.prompt_len)):  # live requests first
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
        chunk.sort(key=lambda s: s.prompt_len)  # for the pieces below
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
        if eng.backend != "cpu":  # pinned: a pageable copy would wait for the pieces launched before this one
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids, mask = ids.to(eng.device, non_blocking=True), mask.to(eng.device, non_blocking=True)
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
        rows = [(i, s) for i, s in enumerate(b.seqs) if not s.finished]
        if not any(s.n_launched < s.limit for _, s in rows):
            if old is not None:
                self._accept(old)
            return
        eng = self.engine
        t0 = time.perf_counter()
        b.grow()
        b.pos = b.pos + 1
        kw = {}
        if eng.is_peft:  # rows prefilled before the base was wrapped run on as base rows
            kw["adapter_names"] = b.adapters or ["__base__"] * len(b.seqs)
        logits = self._forward(input_ids=b.next[:, None], attention_mask=b.mask, position_ids=b.pos[:, None],
                               cache=b.cache, **kw)
        if old is not None and any(s.logits is not None and s.logits.constrained for _, s in rows):
            self._accept(old)
            old = None
        # finished rows' tokens are never read: they take the argmax, unprocessed
        b.next = pick(logits, None, rows, [s.n_launched for _, s in rows])
        for _, s in rows:
            s.n_launched += 1
        b.pending = HostTokens(b.next, rows, eng.backend)
        if old is not None:
            self._accept(old)
        live = b.live()
        eng.stats["decode_steps"] += 1
        eng.stats["decode_rows"] += live
        eng.stats["max_running"] = max(eng.stats["max_running"], live)
        eng.stats["decode_seconds"] += time.perf_counter() - t0
