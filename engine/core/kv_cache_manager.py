"""KVCacheManager: which blocks each request holds, prefix-cache lookup and `allocate_slots`
(stage 4: `Scheduler.schedule` calls both). Engine-core side: no tensors.
"""

from __future__ import annotations

from stepscope.engine.core.block_pool import BlockPool, KVCacheBlock
from stepscope.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.last_blocks_short = 0  # how many blocks the last refused allocation lacked

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        The last prompt token is never counted: the model must run on at least one token to
        produce the logits of the next one. A request that wants its prompt's logprobs gets no
        hit: the model must run on every prompt token to score it.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request blocked at the head of the queue looks
        up again every step; only the lookup that led to admission counts)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens of KV.

        Returns the newly allocated blocks, or None (and changes nothing) when the pool is short.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        computed_hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(computed_hits), 0)
        if not num_new_blocks and not computed_hits:
            # The room is held already (most decodes: part way through their last block).
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
            return []
        # Hits sitting in the free queue stop being free once taken.
        num_hits_free = sum(1 for b in computed_hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hits_free:
            self.last_blocks_short = num_new_blocks - (self.pool.num_free_blocks - num_hits_free)
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed_hits)
        blocks.extend(computed_hits)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached the longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
