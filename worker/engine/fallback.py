"""The fallback path: any causal LM the native decoder does not cover (other architectures, quantized or
multi-device bases, adapters other than plain LoRA), run through the model's own forward.

Why it is shaped this way: the model's own forward costs tens of milliseconds of host time per step whatever the
batch (~25 ms for 24 layers on an H200), so throughput is rows per step, and on a GPU the step is bound by that
host time unless it replays as a device graph. Two ways to batch, chosen per model:

The static batch (where device graphs are, cuda/xpu, or Engine(static_fallback=True), and the model allows it:
plain full-attention cache layers, sdpa or eager attention, no adapters, not quantized, on one device). One row per
slot in fixed buffers: per layer keys and values [slots, heads, capacity, head_dim], the attention mask [slots,
capacity], each row's next token and position. Each row is its own sequence from column 0, so a token's column is
its position; a decode step writes each row's new column at its position, read from a device tensor by the cache
layer (StaticRowsLayer), and attends over the first `span` columns with the mask hiding the rest. The layer is
compileable, as transformers' StaticLayer, so transformers builds the decode mask on the device instead of checking
the padding on the host (masking_utils: the `fast_all` skip) — that check is the host read that breaks capture. So
the step has the same shapes and addresses for a (rows bucket, span bucket) and is captured once and replayed
(graphs.py); only the next tokens, the positions and the bookkeeping run outside. Rows join free slots (prefilled
left padded through a DynamicCache, copied in from column 0 by a gather) and leave by freeing theirs; rows move down
into free low slots when that shrinks the rows bucket. Slots up to the bucket that hold no live row decode garbage,
kept finite (their column 0 stays attended). Sizing: max_batch_size slots of min(max_seq_len, what the KV budget
leaves after one prefill piece's cache and the logits) columns, allocated on first use (or at warm-up, which also
captures the full bucket at every span) after a probe: a 3-token prompt's next step through the static rows must
give the model's own logits. Where the budget gives a slot fewer than max_seq_len columns, one max_seq_len
request's worth is kept out of the buffers and requests longer than a slot take a dynamic batch. A capture that
fails turns capture off (the step runs uncaptured); a step or probe that fails turns the static batch off for the
model; both say why in engine.stats (fallback_graphs), and serving goes on in the dynamic batches.

The dynamic batches (everything else: cpu by default, adapters, sliding windows, other attention kernels, ...).
Every request joins one running batch: new requests are prefilled (left padded, in pieces of at most
prefill_tokens, launched back to back) and their caches merged into the running one at once, left padded to a
common width, in buffers with room for every column its rows may still take: a decode step writes its column in
place, where a DynamicLayer copies its whole cache every step (torch.cat: most of a 256-row decode step's time on
cpu, docs/results/cpu-fallback-profile.md); the attention mask likewise. Finished rows are dropped (and the columns
no row uses any more) once an eighth of the rows are done or the batch holds max_batch_size rows. Caches whose
layers are not plain full-attention DynamicLayers (sliding windows, linear attention) cannot be merged: such a model
runs its prefilled pieces side by side instead. PEFT's mixed-batch `adapter_names=[...]` selects adapters per row.

Both: positions and the attention mask are per row, so padding never changes a row's tokens. The host reads step
k's tokens while the device computes step k+1 (not for a batch holding a grammar-constrained request: its next
mask needs the token just drawn). stats: fallback_decode (how new steps run: graphs, static uncaptured, dynamic),
fallback_graphs (True, or why not), fallback_graph_steps / fallback_static_steps / fallback_dynamic_steps,
fallback_migrations, and the static batch's fallback_static_slots / fallback_static_columns (kv_cache_bytes).

Interface with the engine (engine.py), which owns the request queue, the thread and the results:
  FallbackPath(engine)  once per model setup; reads engine.model/.base/.device/.budget/.prefill_tokens/
                        .max_batch_size/.kv_bytes_per_token/.vocab_size/.use_graphs/.static_fallback and writes
                        into engine.stats
  step()                one iteration: cancels, one decode step per batch (reading the step before's tokens),
                        dropping finished rows, admission
  has_work()            whether requests are running here
  fail_all(error)       finish every running request with an error
  warmup()              the static batch and its graphs ahead of the first request (engine.warmup)
  model_changed()       engine.update_model kept this path: graphs dropped, whether the static batch applies
Requests are finished through engine.accept (a new token) and engine.finish; tokens come from sampling.pick.
"""

from __future__ import annotations

import functools
import heapq
import inspect
import logging
import time
import weakref
from typing import TYPE_CHECKING

import torch

from worker.engine import graphs
from worker.engine.device import HostTokens, graphs_available, to_device
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


@functools.cache
def _static_layer() -> type:
    """The class of the static batch's cache layers (transformers is imported where a fallback model runs)."""
    from transformers.cache_utils import CacheLayerMixin

    class StaticRowsLayer(CacheLayerMixin):
        """One layer of the static batch: keys and values in [slots, heads, capacity, head_dim] buffers, each row
        its own sequence from column 0 (so a token's column is its position). A decode step writes each row's
        column at its position, read from a device tensor (a captured step needs no host value), and attends over
        the first `span` columns. Compileable, as transformers' StaticLayer: the decode mask is then built on the
        device, without the host-side check (fast_all) that would break capture."""

        is_compileable = True
        is_sliding = False

        def __init__(self, k: torch.Tensor, v: torch.Tensor, step: _StepShape):
            super().__init__()
            self.k_full, self.v_full, self.step = k, v, step
            self.device = k.device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            b = self.step
            col = b.pos[:b.rows].to(self.device).view(-1, 1, 1, 1)
            self.k_full[:b.rows].scatter_(2, col.expand_as(key_states), key_states)
            self.v_full[:b.rows].scatter_(2, col.expand_as(value_states), value_states)
            self.keys, self.values = self.k_full[:b.rows, :, :b.span], self.v_full[:b.rows, :, :b.span]
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.step.span, 0

        def get_seq_length(self) -> int:
            # the query's offset for the causal part of the mask: past every column, so the padding mask (each row's
            # written columns) alone decides
            return self.step.span - 1

        def get_max_length(self) -> int:
            return self.k_full.shape[2]

    return StaticRowsLayer


class _StepShape:
    """What the static batch's cache layers read: the step's rows and span, and the positions (a separate object, so
    the layers hold no reference back to the batch and dropping the batch frees its buffers at once)."""

    def __init__(self, pos: torch.Tensor):
        self.pos, self.rows, self.span = pos, 1, 1


class _Static:
    """The static batch: one row per slot in fixed buffers (keys and values per layer, the attention mask, each
    row's next token and position), so a decode step has the same shapes and addresses every time and replays as a
    device graph per (rows bucket, span bucket). Rows join into free slots (their prefilled cache copied to columns
    0..prompt-1) and leave by freeing theirs; nothing else moves, except rows moved down to free low slots when
    that shrinks the rows bucket. Slots past the live rows (up to the bucket) and freed slots decode garbage: every
    row's column 0 stays attended (a prompt's first token, or the step's own write), so it stays finite, and a
    joining row's mask hides what it left behind."""

    def __init__(self, path: FallbackPath, layers, slots: int, cap: int, logits: torch.Tensor):
        from transformers.cache_utils import Cache

        dev = path.engine.device
        self.path = path
        self.slots, self.cap = slots, cap
        self.k = [torch.zeros(slots, lay.keys.shape[1], cap, lay.keys.shape[3], dtype=lay.keys.dtype,
                              device=lay.keys.device) for lay in layers]
        self.v = [torch.zeros(slots, lay.values.shape[1], cap, lay.values.shape[3], dtype=lay.values.dtype,
                              device=lay.values.device) for lay in layers]
        self.mask = torch.zeros(slots, cap, dtype=torch.bool, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.int64, device=dev)  # each row's next input: its position, its column
        self.ids = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.logits = logits.new_zeros(slots, logits.shape[-1])
        self.step = _StepShape(self.pos)  # set by body
        self.cache = Cache(layers=[_static_layer()(k, v, self.step) for k, v in zip(self.k, self.v)])
        self.seqs: list[Sequence | None] = [None] * slots
        self.free = list(range(slots))
        self.pending: HostTokens | None = None
        self.graphs: dict[tuple[int, int], object] = {}
        self.pool = None
        self.buckets = graphs.batch_buckets(slots)
        self.nbytes = sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def held(self) -> bool:
        return self.pending is not None or any(s is not None for s in self.seqs)

    def release_finished(self) -> None:
        for i, s in enumerate(self.seqs):
            if s is not None and s.finished:
                self.seqs[i] = None
                heapq.heappush(self.free, i)

    def join(self, slots: list[int], plens: list[int], cache, toks: torch.Tensor) -> None:
        """Rows of a left-padded prefill (`cache`'s rows, prompts of `plens` tokens) into `slots`: their keys and
        values from column 0, their mask over their prompt, their first token and position."""
        dev = self.mask.device
        index = to_device(slots, torch.int64, dev)
        plen = to_device(plens, torch.int64, dev)
        width = cache.layers[0].keys.shape[2]
        src = (torch.arange(width, device=dev)[None, :] + (width - plen)[:, None]).clamp_(max=width - 1)
        for li, layer in enumerate(cache.layers):
            for full, part in ((self.k[li], layer.keys), (self.v[li], layer.values)):
                cols = src.to(part.device)[:, None, :, None].expand_as(part)
                full[:, :, :width].index_copy_(0, index.to(part.device), part.gather(2, cols))
        self.mask.index_copy_(0, index, torch.arange(self.cap, device=dev)[None, :] < plen[:, None])
        self.pos.index_copy_(0, index, plen)
        self.ids.index_copy_(0, index, toks)

    def compact(self) -> int:
        """Move the rows in slots at or past the live count down into free lower slots, when that shrinks the rows
        bucket (one copy of their written columns per layer)."""
        used = [i for i, s in enumerate(self.seqs) if s is not None]
        n = len(used)
        if not used or self.bucket(used[-1] + 1) <= self.bucket(n):
            return 0
        src = [i for i in used if i >= n]
        dst = sorted(i for i in self.free if i < n)[:len(src)]
        src = src[:len(dst)]
        width = min(self.cap, max(s.prompt_len + s.n_launched for s in (self.seqs[i] for i in src)))
        dev = self.mask.device
        si, di = to_device(src, torch.int64, dev), to_device(dst, torch.int64, dev)
        for buf in (*self.k, *self.v):
            view = buf[:, :, :width]
            view.index_copy_(0, di.to(buf.device), view.index_select(0, si.to(buf.device)))
        for buf in (self.mask, self.pos, self.ids):
            buf.index_copy_(0, di, buf.index_select(0, si))
        for a, b in zip(src, dst):
            seq = self.seqs[a]
            self.seqs[b], self.seqs[a] = seq, None
            seq.slot = b
        self.free = sorted(set(self.free) - set(dst) | set(src))
        return len(src)

    def body(self, rows: int, span: int) -> None:
        """One decode step for slots [0, rows) attending over columns [0, span): what a graph captures. Running it
        again gives the same state (capture runs it first), so positions and tokens advance outside."""
        path = self.path
        self.step.rows, self.step.span = rows, span
        self.mask[:rows].scatter_(1, self.pos[:rows, None], True)
        kw = {"adapter_names": ["__base__"] * rows} if path.engine.is_peft else {}
        logits = path._forward(self.cache, input_ids=self.ids[:rows, None], attention_mask=self.mask[:rows, :span],
                               position_ids=self.pos[:rows, None], **kw)
        self.logits[:rows].copy_(logits)

    def graph(self, rows: int, span: int):
        key = (rows, span)
        if key not in self.graphs:
            eng = self.path.engine
            if self.pool is None:
                self.pool = graphs.new_pool(eng.backend)
            t0 = time.perf_counter()
            self.graphs[key] = graphs.capture(lambda: self.body(rows, span), eng.device, self.pool)
            eng.stats["graphs_captured"] += 1
            eng.stats["graph_capture_seconds"] += time.perf_counter() - t0
        return self.graphs[key]


class FallbackPath:
    def __init__(self, engine: Engine):
        # a proxy: the engine holds this path, and a cycle between them would outlive an evicted engine (with the
        # model's weights) once the worker froze its heap (model_cache.freeze_heap)
        self.engine = weakref.proxy(engine)
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
                            budget_bytes=engine.budget, kv_cache_bytes=0, workspace_estimate_bytes=ws,
                            fallback_graph_steps=0, fallback_static_steps=0, fallback_dynamic_steps=0,
                            fallback_migrations=0)
        self._static: _Static | None = None
        self._broken: str | None = None  # why the static batch failed at run time: it stays off for this model
        self.capture = engine.use_graphs  # the static batch's steps replay graphs (else run uncaptured)
        self._uncaptured = None if self.capture else f"use_graphs off on {engine.backend}"
        self._static_why = self._static_reason()
        self._report()
        # the engine's peak memory counts from here (on a GPU, the engine thread reads it after every step)
        engine._reset_peak()
        engine._mem_base = engine._allocated()

    def _static_reason(self) -> str | None:
        """Why new requests cannot take the static batch (they take today's dynamic batches), or None."""
        eng = self.engine
        cfg = eng.base.config
        impl = getattr(cfg, "_attn_implementation", None)
        if self._broken:
            return self._broken
        if eng.static_fallback is False:
            return "static_fallback=False"
        if eng.static_fallback is None and not eng.use_graphs:
            return f"no device graphs on {eng.backend}" if not graphs_available(eng.backend) else "use_graphs=False"
        if eng.is_peft:
            return "adapters: PEFT picks them per row on the host"
        if impl not in ("sdpa", "eager"):
            return f"attn_implementation {impl!r}: its decode mask is checked on the host"
        if getattr(eng.base, "is_quantized", False) or getattr(cfg, "quantization_config", None) is not None:
            return "quantized base"
        if any(p.device != eng.device for p in eng.model.parameters()):
            return "the model is spread over devices"
        return None

    def _report(self) -> None:
        """stats: how new decode steps run (fallback_decode) and whether they replay graphs, else why not."""
        why = self._static_why
        captured = why is None and self.capture
        self.engine.stats.update(fallback_decode="graphs" if captured else "static" if why is None else "dynamic",
                                 fallback_graphs=True if captured else why or self._uncaptured)

    def _disable_static(self, why: str) -> None:
        log.warning("engine: the fallback's static decode is off for this model (%s); using dynamic batches", why)
        self._broken = why
        self._static_why = why
        self._report()

    def model_changed(self) -> None:
        """engine.update_model kept this path (same layout): graphs hold the old modules, and adapters may have come."""
        self._static_why = self._static_reason()
        if self._static is not None:
            self._static.graphs = {}
            self._drop_idle_static()
        self._report()

    def _drop_idle_static(self, force: bool = False) -> None:
        """A static batch new requests can no longer take gives its memory back once its rows are gone; so does one
        whose engine closed (force), at once: an engine in a reference cycle that gc.freeze exempted
        (model_cache.freeze_heap) would otherwise hold the buffers for good."""
        if self._static is not None and (self._static_why is not None or force) and not self._static.held():
            self._static = None
            self.engine.stats["kv_cache_bytes"] = 0

    def has_work(self) -> bool:
        return bool(self._batches) or (self._static is not None and self._static.held())

    def fail_all(self, error: str) -> None:
        for b in self._batches:
            for seq in b.seqs:
                self.engine.finish(seq, "error", error)
        self._batches = []
        st = self._static
        if st is not None:
            for seq in st.seqs:
                if seq is not None:
                    self.engine.finish(seq, "error", error)
            st.pending = None
            st.release_finished()
            self._drop_idle_static(force=self.engine._closed)

    def _forward(self, cache, **kw):
        kw[self._cache_kwarg] = cache
        return self.engine.model(use_cache=True, return_dict=True, logits_to_keep=1, **kw).logits[:, -1, :]

    def step(self) -> None:
        eng = self.engine
        st = self._static
        cancels = eng.take_cancels()
        if cancels:
            seqs = [seq for b in self._batches for seq in b.seqs]
            seqs += [seq for seq in st.seqs if seq is not None] if st is not None else []
            for seq in seqs:
                if seq.req.request_id in cancels:
                    eng.finish(seq, "cancelled")
        for b in self._batches:
            self._decode(b)
        if st is not None:
            self._decode_static(st)
            st.release_finished()
            self._drop_idle_static()
        for b in list(self._batches):
            done = len(b.seqs) - b.live()
            if done == len(b.seqs) and b.pending is None:
                self._batches.remove(b)
            elif done and (8 * done >= len(b.seqs) or len(b.seqs) >= eng.max_batch_size):
                b.compact()
        self._admit()

    def warmup(self) -> None:
        """Allocate the static batch and capture its decode step for the full rows bucket at every span, so the
        first requests wait for no capture. A failure here turns capture off (stats say why); serving goes on."""
        if self._static_why is not None or not self.capture:
            return
        st = self._ensure_static()
        if st is None:
            return
        # The captures run the step on whatever the slots hold: running rows (warmup after update_model) get the
        # same column written as their next step will write, free ones garbage, as ever.
        cap = st.cap
        try:
            for span in sorted({graphs.length_bucket(n, cap) for n in range(1, cap + 1)}):
                st.graph(st.buckets[-1], span)
        except Exception as e:
            self._capture_failed(e)

    def _capture_failed(self, e: Exception) -> None:
        log.warning("engine: capturing the fallback's decode step failed (%s: %s); running it uncaptured",
                    type(e).__name__, e)
        self.capture = False
        self._uncaptured = f"capture failed: {type(e).__name__}: {e}"
        if self._static is not None:
            self._static.graphs = {}
        self.engine.sync()
        self._report()

    def _ensure_static(self) -> _Static | None:
        """The static batch, allocated on first use after a probe: a 3-token prompt's next step through the static
        rows must give the model's own logits (through a DynamicCache), else the static batch stays off."""
        if self._static is None:
            try:
                self._static = self._new_static()
            except Exception as e:
                log.exception("engine: the fallback's static batch failed its probe")
                self._disable_static(f"probe failed: {type(e).__name__}: {e}")
            if self._static is not None:
                self.engine.stats.update(kv_cache_bytes=self._static.nbytes, fallback_static_slots=self._static.slots,
                                         fallback_static_columns=self._static.cap)
        return self._static

    def _new_static(self) -> _Static | None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        eng = self.engine
        dev = eng.device
        ids = torch.tensor([[t % eng.vocab_size for t in (1, 2, 3)]], device=dev)
        cache = DynamicCache(config=eng.base.config)
        logits = self._forward(cache, input_ids=ids, attention_mask=torch.ones_like(ids),
                               position_ids=torch.arange(3, device=dev)[None])
        layers = cache.layers
        kinds = {type(lay).__name__ for lay in layers if type(lay) is not DynamicLayer or lay.keys is None}
        if not layers or kinds:
            self._disable_static(f"cache layers {sorted(kinds)} are not plain full attention")
            return None
        # Sizing: max_batch_size slots of `cap` columns each, in what the KV budget leaves after one prefill piece's
        # cache (it sits beside the buffers until copied in) and the logits. Where that is under max_seq_len
        # columns, one max_seq_len request's worth stays out of the buffers: requests longer than a slot take a
        # dynamic batch there. Fewer slots only where a slot would get under a quarter of max_seq_len.
        per = sum((lay.keys[0, :, 0].numel() + lay.values[0, :, 0].numel()) * lay.keys.element_size()
                  for lay in layers)
        tokens = (self._kv_budget - eng.prefill_tokens * per - eng.max_batch_size * eng.vocab_size * 8) // per
        slots = eng.max_batch_size
        while True:
            cap = min(eng.max_seq_len, tokens // slots)
            if cap < eng.max_seq_len:
                cap = (tokens - eng.max_seq_len - 1) // slots
            if slots == 1 or cap >= eng.max_seq_len // 4:
                break
            slots //= 2
        if cap < 2:
            self._disable_static(f"the KV budget ({self._kv_budget} bytes) leaves no room for static rows")
            return None
        st = _Static(self, layers, slots, cap, logits)
        nxt = logits.argmax(-1)
        st.join([0], [3], cache, nxt)
        ref = self._forward(cache, input_ids=nxt[:, None], attention_mask=torch.ones(1, 4, dtype=torch.int64,
                                                                                     device=dev),
                            position_ids=torch.tensor([[3]], device=dev))
        st.body(1, graphs.length_bucket(4, cap))  # slot 0 is left as a finished row leaves its slot
        got, ref = st.logits[:1].float(), ref.float()
        err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
        # float32 gives the same logits to rounding; 16-bit types leave room for another attention kernel's (the
        # masked one over the span against the unmasked one over 4 columns)
        if not err <= (1e-3 if logits.dtype == torch.float32 else 0.1):
            self._disable_static(f"its decode step's logits differ from the model's own by {err:.3g} (relative)")
            return None
        log.info("engine: fallback static batch of %d slots x %d columns (%d bytes)", slots, cap, st.nbytes)
        return st

    def _decode_static(self, st: _Static) -> None:
        """_decode for the static batch: one step for its slots up to the live rows' bucket, over the columns up to
        the longest row's bucket, as a graph replay where capture is on."""
        eng = self.engine
        old, st.pending = st.pending, None
        st.release_finished()
        rows = [(i, s) for i, s in enumerate(st.seqs) if s is not None and not s.finished]
        if not any(s.n_launched < s.limit for _, s in rows):
            if old is not None:
                self._accept(old)
            return
        t0 = time.perf_counter()
        moved = st.compact()
        if moved:
            eng.stats["fallback_migrations"] += moved
            rows = [(i, s) for i, s in enumerate(st.seqs) if s is not None and not s.finished]
        R = st.bucket(max(i for i, _ in rows) + 1)
        span = graphs.length_bucket(max(s.prompt_len + s.n_launched for _, s in rows), st.cap)
        self._run_static(st, R, span)
        if old is not None and any(s.logits is not None and s.logits.constrained for _, s in rows):
            self._accept(old)
            old = None
        toks = pick(st.logits[:R], None, rows, [s.n_launched for _, s in rows], self.engine.draw)
        st.ids[:R].copy_(toks)
        st.pos[:R].add_(1).clamp_(max=st.cap - 1)  # a garbage row's column stays inside the buffers
        for _, s in rows:
            s.n_launched += 1
        st.pending = HostTokens(toks, rows, eng.backend)
        if old is not None:
            self._accept(old)
        live = sum(not s.finished for _, s in rows)
        eng.stats["decode_steps"] += 1
        eng.stats["decode_rows"] += live
        eng.stats["max_running"] = max(eng.stats["max_running"], live)
        eng.stats["decode_seconds"] += time.perf_counter() - t0

    def _run_static(self, st: _Static, rows: int, span: int) -> None:
        eng = self.engine
        if self.capture and not eng.is_peft:
            try:
                st.graph(rows, span).replay()
                eng.stats["fallback_graph_steps"] += 1
                return
            except Exception as e:
                self._capture_failed(e)
        try:
            st.body(rows, span)
        except Exception as e:
            self._disable_static(f"decode failed: {type(e).__name__}: {e}")
            raise
        eng.stats["fallback_static_steps"] += 1

    def _accept(self, out: HostTokens) -> None:
        host = out.tokens()
        for i, seq in out.rows:
            self.engine.accept(seq, host[i])

    def _admit(self) -> None:
        """Waiting requests join the static batch where it is on and they fit its columns (those beyond its free
        slots wait for one); the others (all, where it is off) a dynamic batch while rows and the KV budget allow:
        the budget (less the static batch's buffers, if there is one) bounds rows x (width + the longest output
        still to come), what the merged cache may grow to."""
        eng = self.engine
        st = self._ensure_static() if self._static_why is None else self._static
        room = eng.max_batch_size - sum(b.live() for b in self._batches)
        room -= sum(s is not None and not s.finished for s in st.seqs) if st is not None else 0
        if room <= 0:
            return
        cands = eng.pop_waiting(room)
        if st is not None and self._static_why is None:
            fit = [s for s in cands if s.prompt_len + s.limit - 1 <= st.cap]  # every column but the last token's
            cands = [s for s in cands if s.prompt_len + s.limit - 1 > st.cap]
            eng.push_back(fit[len(st.free):])
            self._admit_static(st, fit[:len(st.free)])
        if cands:
            self._admit_dynamic(cands, st)

    def _admit_dynamic(self, cands: list[Sequence], st: _Static | None) -> None:
        eng = self.engine
        budget = (self._kv_budget - (st.nbytes if st is not None else 0)) // eng.kv_bytes_per_token
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
        t0 = time.perf_counter()
        fresh: list[_Batch] = []
        for piece in self._pieces(chunk):
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

    def _pieces(self, chunk: list[Sequence]):
        """`chunk` in prefill calls of at most prefill_tokens padded tokens (sorted by length, so each piece's last
        prompt is its longest)."""
        chunk = sorted(chunk, key=lambda s: s.prompt_len)
        i = 0
        while i < len(chunk):
            j = i + 1
            while j < len(chunk) and (j + 1 - i) * chunk[j].prompt_len <= self.engine.prefill_tokens:
                j += 1
            yield chunk[i:j]
            i = j

    def _admit_static(self, st: _Static, chunk: list[Sequence]) -> None:
        """`chunk` into free slots of the static batch: each piece is prefilled through a DynamicCache and copied
        into its slots at once (so one piece's cache is alive at a time), then the first tokens of all pieces are
        read."""
        eng = self.engine
        if not chunk:
            return
        t0 = time.perf_counter()
        firsts = []
        for piece in self._pieces(chunk):
            slots = []
            try:
                b = self._prefill(piece)
                slots = [heapq.heappop(st.free) for _ in piece]
                st.join(slots, [s.prompt_len for s in piece], b.cache, b.next)
            except Exception as e:
                log.exception("prefill failed")
                for slot in slots:
                    heapq.heappush(st.free, slot)
                for seq in piece:
                    eng.finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
                continue
            for slot, seq in zip(slots, piece):
                seq.slot = slot
                st.seqs[slot] = seq
            firsts.append(b.pending)
        for out in firsts:
            self._accept(out)
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
        toks = pick(logits, None, rows, [0] * n, self.engine.draw)
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
        b.next = pick(logits, None, rows, [s.n_launched for _, s in rows], self.engine.draw)
        for _, s in rows:
            s.n_launched += 1
        b.pending = HostTokens(b.next, rows, eng.backend)
        if old is not None:
            self._accept(old)
        live = b.live()
        eng.stats["decode_steps"] += 1
        eng.stats["fallback_dynamic_steps"] += 1
        eng.stats["decode_rows"] += live
        eng.stats["max_running"] = max(eng.stats["max_running"], live)
        eng.stats["decode_seconds"] += time.perf_counter() - t0
