"""The paged KV cache: fixed-size blocks of token slots and a reference-counted block allocator.

Layout per layer: K and V are [num_blocks, num_kv_heads, block_size, head_dim], so one (block,
head) is a contiguous block_size x head_dim tile that the decode kernel loads in one piece.
Block 0 is never handed out: padded rows of a decode batch point at it and write there harmlessly.
"""

from __future__ import annotations

import torch


class BlockAllocator:
    """Block ids with reference counts (a prompt's full blocks are shared by its n samples and come
    back when the last sample releases them).

    Ids never handed out are a counter, not a list: the cache is made again at every wake (each
    step), and a free list of every id cost ~3-6 ms of Python a step at a default-sized cache (~200k
    blocks) while the GPU waited. Returned blocks are handed out again first, the last returned first,
    then the lowest id never handed out: the order a free list of all ids (lowest popped first) gave."""

    def __init__(self, num_blocks: int):
        assert num_blocks >= 2, "block 0 is the scratch block; at least one more is needed"
        self.num_blocks = num_blocks
        self._released: list[int] = []  # blocks handed out before and returned since
        self._next = 1  # the lowest id never handed out
        self._refs: dict[int, int] = {}  # reference counts of the blocks in use

    @property
    def num_free(self) -> int:
        return len(self._released) + self.num_blocks - self._next

    def allocate(self, count: int) -> list[int]:
        assert count <= self.num_free, "the scheduler reserves blocks before allocating"
        reused = min(count, len(self._released))
        blocks = [self._released.pop() for _ in range(reused)]
        fresh = count - reused
        blocks.extend(range(self._next, self._next + fresh))
        self._next += fresh
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int], extra_refs: int) -> None:
        for b in blocks:
            self._refs[b] += extra_refs

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            refs = self._refs.get(b, 0) - 1
            assert refs >= 0, f"block {b} released twice"
            if refs == 0:
                del self._refs[b]
                self._released.append(b)
            else:
                self._refs[b] = refs


class PagedKVCache:
    """K and V tensors for every layer, [L, num_blocks, Hkv, block_size, D] each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)

    # The Triton decode attention indexes a layer's K (or V) cache with 32-bit element offsets.
    MAX_LAYER_ELEMENTS = 2**31 - 1

    @staticmethod
    def max_blocks(num_kv_heads: int, block_size: int, head_dim: int) -> int:
        """The most blocks a cache can hold with each layer's K (or V) within 32-bit offsets."""
        return PagedKVCache.MAX_LAYER_ELEMENTS // (num_kv_heads * block_size * head_dim)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write at fork: sample j gets its own copy of the prompt's last partial block."""
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]


class CacheAddresses:
    """Where the Triton decode kernels find each layer's K and V cache: element offsets from a fixed
    anchor tensor, in a small device buffer the kernels read when they run (triton_kernels.
    _cache_pointers). A captured decode graph then bakes in the anchor and this buffer instead of
    the cache, and stays valid when sleep() frees the cache and the next wake() gets it back at
    another address: `point_at` rewrites the offsets in place."""

    ALIGN = 8  # elements; every offset is a multiple, so the kernels' cache loads stay vectorised

    def __init__(self, num_layers: int, dtype: torch.dtype, device: torch.device):
        self.anchor = torch.empty(1, dtype=dtype, device=device)
        self.offsets = torch.zeros(num_layers, 2, dtype=torch.int64, device=device)

    def point_at(self, cache: PagedKVCache) -> None:
        """The offsets of `cache`'s layers (queued on the current stream, before any graph replay)."""
        base, size = self.anchor.data_ptr(), self.anchor.element_size()
        assert cache.k.dtype == self.anchor.dtype and cache.k.shape[0] == self.offsets.shape[0]
        offsets = []
        for layer in range(cache.k.shape[0]):
            for t in (cache.k[layer], cache.v[layer]):
                delta = t.data_ptr() - base
                align = self.ALIGN * size
                assert delta % align == 0, f"cache layer at {t.data_ptr():#x} is not {align}-byte aligned"
                offsets.append(delta // size)
        host = torch.tensor(offsets, dtype=torch.int64).view(-1, 2)
        if self.offsets.is_cuda:  # through pinned memory: no wait for the queue to drain (models.loading.to_device)
            host = host.pin_memory()
        self.offsets.copy_(host, non_blocking=True)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchor, offsets of `layer`'s K and V): the `kv_table` argument of the Triton decode ops."""
        return self.anchor, self.offsets[layer]

    def tensors(self) -> list[torch.Tensor]:
        return [self.anchor, self.offsets]
