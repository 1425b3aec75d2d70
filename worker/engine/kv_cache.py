"""The paged KV cache's bookkeeping (PagedAttention style, as vLLM's block pool and KV cache manager): the cache
is `num_blocks` blocks of `block_size` token positions each, and a sequence holds a block table, the blocks its
tokens so far occupy, in order. A request therefore holds the cache it has used, not its longest possible length;
blocks return to the pool when it finishes or is preempted.

This module is pure logic (no tensors): the engine keeps the tensors ([num_blocks + 1, block_size, kv_heads,
head_dim] per layer for keys and for values, the extra block a scratch area that padding rows write into) and asks
the manager which block a token position lives in.
"""

from __future__ import annotations

from collections.abc import Hashable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Freed blocks go on top and are reused first (their memory is the most recently touched).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def scratch_block(self) -> int:
        """The block past the pool: writes that must land somewhere harmless (padding rows) go there."""
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, owner: Hashable) -> list[int]:
        return self._tables.get(owner, [])

    def holds(self, owner: Hashable) -> bool:
        return owner in self._tables

    def missing(self, owner: Hashable, tokens: int) -> int:
        """Blocks `owner` still needs so that its table covers `tokens` positions."""
        return max(0, self.blocks_for(tokens) - len(self.table(owner)))

    def ensure(self, owner: Hashable, tokens: int) -> list[int] | None:
        """Grow owner's table to cover `tokens` positions. Returns the blocks added (maybe none), or None, taking
        nothing, when the pool has too few free blocks."""
        need = self.missing(owner, tokens)
        if need > len(self._free):
            return None
        added = [self._free.pop() for _ in range(need)]
        self._tables.setdefault(owner, []).extend(added)
        return added

    def release(self, owner: Hashable) -> int:
        """Return owner's blocks to the pool; the number returned."""
        blocks = self._tables.pop(owner, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def slot(self, owner: Hashable, position: int) -> int:
        """The flat cache index (block * block_size + offset) of token `position` of owner."""
        table = self._tables[owner]
        return table[position // self.block_size] * self.block_size + position % self.block_size
