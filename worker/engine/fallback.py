"""The fallback path: any causal LM the native decoder does not cover (other architectures, quantized or
multi-device bases, adapters other than plain LoRA), run through the model's own forward with a DynamicCache.
Requests are batched in "cohorts" that join between steps; PEFT's mixed-batch `adapter_names=[...]` selects
adapters per row. Correct, but host-bound like `generate`.

Interface with the engine (engine.py), which owns the request queue, the thread and the results:
  FallbackPath(engine)  once per model setup; reads engine.model/.base/.device/.budget/.prefill_tokens/
                        .max_batch_size/.kv_bytes_per_token/.vocab_size and writes into engine.stats
  step()                one iteration: cancels, admission (engine.pop_waiting / push_back), one decode step
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

from worker.engine.sampling import pick

if TYPE_CHECKING:
    from worker.engine.engine import Engine, Sequence

log = logging.getLogger(__name__)


class FallbackPath:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cohorts: list[dict] = []
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

    def has_work(self) -> bool:
        return bool(self._cohorts)

    def fail_all(self, error: str) -> None:
        for c in self._cohorts:
            for seq in c["seqs"]:
                self.engine.finish(seq, "error", error)
        self._cohorts = []

    def _forward(self, cache, **kw):
        kw[self._cache_kwarg] = cache
        return self.engine.model(use_cache=True, return_dict=True, logits_to_keep=1, **kw).logits[:, -1, :]

    def step(self) -> None:
        from transformers import DynamicCache

        eng = self.engine
        cancels = eng.take_cancels()
        if cancels:
            for c in self._cohorts:
                for seq in c["seqs"]:
                    if seq.req.request_id in cancels:
                        eng.finish(seq, "cancelled")
        # Admit a new cohort while rows and the KV budget allow it.
        running = sum(len(c["seqs"]) for c in self._cohorts)
        reserved = sum(c["reserve"] for c in self._cohorts)
        room = eng.max_batch_size - running
        if room > 0:
            cands = eng.pop_waiting(room)
            chunk, tokens = [], 0
            for s in sorted(cands, key=lambda s: s.prompt_len):
                need = (s.prompt_len + s.limit) * eng.kv_bytes_per_token
                if need > self._kv_budget:
                    eng.finish(s, "error", f"the prompt plus max_new_tokens needs {need} bytes of KV cache, more "
                                           f"than the memory budget allows ({self._kv_budget})")
                    continue
                if chunk and (len(chunk) + 1) * s.prompt_len > eng.prefill_tokens:
                    break
                if reserved + tokens + need > self._kv_budget:
                    break
                chunk.append(s)
                tokens += need
            taken = {id(s) for s in chunk}
            eng.push_back([s for s in cands if id(s) not in taken and not s.finished])
            if chunk:
                t0 = time.perf_counter()
                try:
                    self._prefill(chunk, tokens, DynamicCache)
                except Exception as e:
                    log.exception("prefill failed")
                    for seq in chunk:
                        eng.finish(seq, "error", f"prefill failed: {type(e).__name__}: {e}")
                eng.stats["prefill_seconds"] += time.perf_counter() - t0
        # One decode step per cohort.
        for c in list(self._cohorts):
            if all(s.finished for s in c["seqs"]):
                self._cohorts.remove(c)
                continue
            t0 = time.perf_counter()
            c["mask"] = torch.cat([c["mask"], c["mask"].new_ones(c["mask"].shape[0], 1)], dim=1)
            c["pos"] = c["pos"] + 1
            kw = {}
            if eng.is_peft:  # a cohort started before the base was wrapped runs on as base rows
                kw["adapter_names"] = c["adapters"] or ["__base__"] * len(c["seqs"])
            logits = self._forward(input_ids=c["next"][:, None], attention_mask=c["mask"],
                                   position_ids=c["pos"][:, None], cache=c["cache"], **kw)
            rows = list(enumerate(c["seqs"]))
            toks = pick(logits, None, rows, [len(s.out) for s in c["seqs"]])
            c["next"] = toks
            host = toks.tolist()
            live = [s for s in c["seqs"] if not s.finished]
            for i, seq in rows:
                eng.accept(seq, host[i])
            eng.stats["decode_steps"] += 1
            eng.stats["decode_rows"] += len(live)
            eng.stats["max_running"] = max(eng.stats["max_running"], len(live))
            eng.stats["decode_seconds"] += time.perf_counter() - t0
            if all(s.finished for s in c["seqs"]):
                self._cohorts.remove(c)

    def _prefill(self, chunk: list[Sequence], reserve: int, cache_cls) -> None:
        eng = self.engine
        dev = eng.device
        n = len(chunk)
        L = max(s.prompt_len for s in chunk)
        pad = getattr(eng.base.config, "pad_token_id", None)
        pad = 0 if pad is None else pad
        ids = torch.full((n, L), pad, dtype=torch.int64)
        mask = torch.zeros(n, L, dtype=torch.int64)
        for i, s in enumerate(chunk):  # left padding
            ids[i, L - s.prompt_len:] = torch.tensor(s.req.prompt_ids)
            mask[i, L - s.prompt_len:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = None
        if eng.is_peft:
            adapters = [s.req.adapter if s.req.adapter is not None else "__base__" for s in chunk]
        cache = cache_cls(config=eng.base.config)
        kw = {"adapter_names": adapters} if adapters is not None else {}
        logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, **kw)
        rows = list(enumerate(chunk))
        toks = pick(logits, None, rows, [0] * n)
        c = {"seqs": chunk, "cache": cache, "mask": mask, "pos": pos[:, -1], "next": toks, "adapters": adapters,
             "reserve": reserve}
        self._cohorts.append(c)
        host = toks.tolist()
        for i, seq in rows:
            seq.n_launched = 1
            eng.accept(seq, host[i])
        eng.stats["prefill_calls"] += 1
        eng.stats["prefill_tokens"] += sum(s.prompt_len for s in chunk)
        eng.stats["prefill_padded_tokens"] += n * L
        if all(s.finished for s in chunk):
            self._cohorts.remove(c)
