"""The paged KV cache's bookkeeping (PagedAttention style, as vLLM's block pool and KV cache manager): the cache
is `num_blocks` blocks of `block_size` token positions each, and a sequence holds a block table, the blocks its
tokens so far occupy, in order. A request therefore holds the cache it has used, not its longest possible length;
blocks return to the pool when it finishes or is preempted.

Prefix sharing: a full block of prompt tokens, once computed, is registered under a hash of its tokens and every
token before it (and the adapter, whose weights change the keys and values). A later request whose prompt starts
with the same blocks takes them into its table (reference counted) instead of computing them again. A registered
block whose last holder is gone stays in the pool with its contents, reused for its prefix until the pool needs it
for something else (least recently freed first; blocks that hold nothing are taken before them).

This module is pure logic (no tensors): the engine keeps the tensors ([num_blocks + 1, block_size, kv_heads,
head_dim] per layer for keys and for values, the extra block a scratch area that padding rows write into) and asks
the manager which block a token position lives in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks holding nothing (taken first; freed ones go on top, their memory the most recently touched)
        # and free blocks holding a registered prefix (taken least recently freed first, when no empty one is left).
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._key_of: dict[int, tuple] = {}  # registered block -> its key
        self._block_of: dict[tuple, int] = {}  # key -> registered block
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def scratch_block(self) -> int:
        """The block past the pool: writes that must land somewhere harmless (padding rows) go there."""
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

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
        if need > self.num_free:
            return None
        added = [self._take() for _ in range(need)]
        self._tables.setdefault(owner, []).extend(added)
        return added

    def _take(self) -> int:
        if self._empty:
            block = self._empty.pop()
        else:  # the least recently freed registered block: its prefix is forgotten
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block

    def release(self, owner: Hashable) -> int:
        """Return owner's blocks to the pool (shared ones once their last holder goes); the number it held."""
        blocks = self._tables.pop(owner, [])
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._empty.append(block)
        return len(blocks)

    def slot(self, owner: Hashable, position: int) -> int:
        """The flat cache index (block * block_size + offset) of token `position` of owner."""
        table = self._tables[owner]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------------------------------------ prefix sharing

    def _keys(self, salt: Hashable, tokens: Sequence[int], blocks: int):
        """The key of each of the first `blocks` full blocks of tokens: the block's tokens and its parent's key's
        hash, so a block matches only after the same tokens from the start."""
        parent = hash(("prefix", salt))
        bs = self.block_size
        for i in range(blocks):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            yield key
            parent = hash(key)

    def match(self, salt: Hashable, tokens: Sequence[int]) -> list[int]:
        """The registered blocks holding the longest run of tokens' full blocks from the start, leaving at least
        one token to compute (the request needs its last position's logits)."""
        found = []
        for key in self._keys(salt, tokens, (len(tokens) - 1) // self.block_size):
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def share(self, owner: Hashable, blocks: list[int]) -> None:
        """Start owner's (empty) table with registered blocks that match() found."""
        assert not self.table(owner)
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        if blocks:
            self._tables[owner] = list(blocks)

    def register(self, owner: Hashable, salt: Hashable, tokens: Sequence[int], computed: int) -> None:
        """Register owner's full blocks among its first `computed` positions (tokens[:computed] in its cache), so
        later requests can share them."""
        table = self.table(owner)
        for i, key in enumerate(self._keys(salt, tokens, min(computed // self.block_size, len(table)))):
            block = table[i]
            if block in self._key_of or key in self._block_of:
                continue  # shared already, or the same tokens computed twice: the first copy serves
            self._key_of[block] = key
            self._block_of[key] = block
