"""The native backend's Triton kernels against their PyTorch references (ops_torch, sampling).

Runs on a CUDA GPU, or on CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton
installed); skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from conftest import interpreter_loops_to_runtime_bounds  # noqa: E402
from hybridrl.rollout.native import triton_attention, triton_kernels, triton_sampling  # noqa: E402
from hybridrl.rollout.native.ops_torch import TorchOps  # noqa: E402
from hybridrl.rollout.native.sampling import SAMPLE_CHUNK, SamplingParams, sample  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])

needs_runtime_loop_bounds = pytest.mark.skipif(
    DEVICE != "cuda" and not interpreter_loops_to_runtime_bounds(), reason="kernels that loop to a run-time bound need numpy < 2.4 under Triton 3.6's interpreter"
)


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    r = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    w = torch.randn(96, generator=g).to(DEVICE, dtype)
    ref_out, ref_res = TorchOps().add_rms_norm(x, r.clone(), w, 1e-6)
    out, res = triton_kernels.add_rms_norm(x, r.clone(), w, 1e-6)
    torch.testing.assert_close(res, ref_res, **_tol(dtype))
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    out0, res0 = triton_kernels.add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(out0, TorchOps().add_rms_norm(x, None, w, 1e-6)[0], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_rope_write_kv(dtype, qk_norm):
    g = torch.Generator().manual_seed(1)
    batch, hq, hkv, d, bs, nb = 3, 6, 2, 16, 4, 10
    # q, k, v as column slices of one fused q|k|v projection (strided rows), as the decoder has.
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    pos = torch.tensor([0, 5, 11], device=DEVICE)
    ang = torch.rand(32, d // 2, generator=g).to(DEVICE) * 6
    cos, sin = ang.cos(), ang.sin()
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    bt = torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 7, 8]], device=DEVICE, dtype=torch.int32)
    caches = [torch.zeros(nb, hkv, bs, d, device=DEVICE, dtype=dtype) for _ in range(4)]
    ref_q = TorchOps().qk_rope_write_kv(q, k, v, pos, cos, sin, qn, kn, 1e-6, caches[0], caches[1], bt)
    out_q = triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, qn, kn, 1e-6, caches[2], caches[3], bt)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(caches[2], caches[0], **_tol(dtype))
    torch.testing.assert_close(caches[3], caches[1], **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_prefill_rope_write_kv_rotates_every_token_and_caches_the_real_ones(dtype, qk_norm):
    g = torch.Generator().manual_seed(2)
    prompts, width, hq, hkv, d, bs, nb = 3, 6, 6, 2, 16, 4, 12
    qkv = torch.randn(prompts * width, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)  # strided rows, as the fused projection gives
    lengths = torch.tensor([6, 3, 5], device=DEVICE)
    tables = [[1, 2], [3, 0], [4, 5]]
    slots = torch.zeros(prompts, width, dtype=torch.int64)
    for p_, (n, table) in enumerate(zip(lengths.tolist(), tables)):
        slots[p_, :n] = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    slots = slots.to(DEVICE)
    valid_index = torch.cat([p_ * width + torch.arange(n) for p_, n in enumerate(lengths.tolist())]).to(DEVICE)
    ang = torch.rand(32, d // 2, generator=g).to(DEVICE) * 6
    cos, sin = ang.cos(), ang.sin()
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    caches = [torch.zeros(nb, hkv, bs, d, device=DEVICE, dtype=dtype) for _ in range(4)]
    ref_q, ref_k = TorchOps().prefill_rope_write_kv(q, k, v, lengths, slots, valid_index, cos, sin, qn, kn, 1e-6, caches[0], caches[1])
    out_q, out_k = triton_kernels.prefill_rope_write_kv(q, k, v, lengths, slots, cos, sin, qn, kn, 1e-6, caches[2], caches[3])
    assert out_q.shape == ref_q.shape == (prompts * width, hq, d) and out_k.shape == ref_k.shape == (prompts * width, hkv, d)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **_tol(dtype))
    torch.testing.assert_close(caches[2], caches[0], **_tol(dtype))
    torch.testing.assert_close(caches[3], caches[1], **_tol(dtype))
    # Padded tokens wrote nothing: exactly the real tokens' slots (and block 0, the scratch block, none) are set.
    written = caches[3].abs().sum((1, 3)).flatten() != 0  # per (block, offset) slot, over heads and dims
    expected = torch.zeros(nb * bs, dtype=torch.bool, device=DEVICE)
    expected[slots.flatten()[valid_index]] = True
    assert torch.equal(written, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention(dtype):
    g = torch.Generator().manual_seed(2)
    batch, hq, hkv, d, bs, nb, mb = 4, 14, 2, 64, 16, 40, 9
    q = torch.randn(batch, hq, d, generator=g).to(DEVICE, dtype)
    kc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    vc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    bt = torch.randperm(nb - 1, generator=g)[: batch * mb].view(batch, mb).add(1).to(DEVICE, torch.int32)
    ctx = torch.tensor([1, 17, 64, 140], device=DEVICE)
    ref = TorchOps().decode_attention(q, kc, vc, bt, ctx, d**-0.5)
    for tile, split in ((16, 0), (64, 0), (16, 32), (64, 64)):
        out = triton_attention.paged_decode_attention(q, kc, vc, bt, ctx, d**-0.5, tile=tile, split_tokens=split)
        torch.testing.assert_close(out, ref, **_tol(dtype))


def test_decode_attention_refuses_a_cache_past_32_bit_offsets():
    """The attention loop indexes a layer's cache in 32 bits: a cache one block past that is refused
    before any launch, with the largest block count that fits; PagedKVCache.max_blocks gives the same."""
    from hybridrl.rollout.native.kv_cache import PagedKVCache

    hkv, bs, d = 2, 16, 64
    most = PagedKVCache.max_blocks(hkv, bs, d)
    assert most * hkv * bs * d <= 2**31 - 1 < (most + 1) * hkv * bs * d
    q = torch.zeros(1, 14, d, device=DEVICE, dtype=torch.bfloat16)
    too_big = torch.empty(most + 1, hkv, bs, d, device="meta", dtype=torch.bfloat16)  # no memory behind it
    bt = torch.zeros(1, 1, device=DEVICE, dtype=torch.int32)
    ctx = torch.ones(1, device=DEVICE, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"at most {most:,} blocks"):
        triton_attention.paged_decode_attention(q, too_big, too_big, bt, ctx, d**-0.5)
    kv = torch.zeros(1, hkv * d, device=DEVICE, dtype=torch.bfloat16)
    cos = torch.ones(4, d // 2, device=DEVICE)
    with pytest.raises(ValueError, match="32-bit offsets"):
        triton_attention.rope_paged_decode_attention(
            q.view(1, -1), kv, kv, ctx, cos, cos, None, None, 1e-6, too_big, too_big, bt, d**-0.5
        )


@pytest.mark.skipif(DEVICE != "cuda", reason="two 4 GiB caches: too large for the interpreter")
def test_cache_kernels_reach_the_last_block_of_a_32_bit_cache():
    """Blocks at the very top of the largest cache 32-bit offsets allow (each layer's K and V ~4 GiB)
    are written and read exactly as the same blocks of a small cache: the decode attention (with and
    without splits), the fused rotary + cache write + attention in the engine's settings, and the
    rotary cache write alone give bit-identical results on both. (The refusal one block past it:
    test_decode_attention_refuses_a_cache_past_32_bit_offsets.)"""
    from hybridrl.rollout.native.kv_cache import PagedKVCache
    from hybridrl.rollout.native.ops_triton import TritonOps

    hq, hkv, d, bs, mb = 14, 2, 64, 16, 9
    most = PagedKVCache.max_blocks(hkv, bs, d)
    need = 2 * most * hkv * bs * d * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    g = torch.Generator().manual_seed(13)
    pos, q, k, v, cos, sin, small_bt = _decode_step_inputs(g, torch.bfloat16, hq, hkv, d, 50, mb)
    used = small_bt.flatten().unique()  # the small cache's blocks these rows use
    # The big cache's block for each used one: the topmost blocks, the last one (most - 1) included.
    top = torch.arange(most - 1, most - 1 - used.numel(), -1, device=DEVICE, dtype=torch.int32)
    remap = torch.zeros(50, device=DEVICE, dtype=torch.int32)
    remap[used.long()] = top
    big_bt = remap[small_bt.long()]
    small = [torch.randn(50, hkv, bs, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2)]
    big = [torch.empty(most, hkv, bs, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    assert big[0].numel() <= PagedKVCache.MAX_LAYER_ELEMENTS < big[0].numel() + hkv * bs * d
    for b, s in zip(big, small):
        b[top.long()] = s[used.long()]

    def run(caches, bt):
        kc, vc = caches
        outs = [triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt)]
        for split in (0, 64):
            outs.append(triton_attention.paged_decode_attention(outs[0], kc, vc, bt, pos + 1, d**-0.5, tile=64, split_tokens=split))
        outs.append(TritonOps().rope_decode_attention(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, d**-0.5))
        return outs + [kc, vc]

    want = run(small, small_bt)
    got = run(big, big_bt)
    for name, a, b in zip(["rotated q", "attention", "split attention", "fused attention"], got, want):
        assert torch.equal(a, b), name
    for name, b, s in zip("KV", got[-2:], want[-2:]):
        assert torch.equal(b[top.long()], s[used.long()]), f"{name} cache"
    assert want[1].float().abs().sum() > 0


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_advance_kernel_matches_the_decode_state_bookkeeping(batch):
    """One kernel for a decode step's bookkeeping: record the token and log-prob of each active row
    (finished rows write to the trash column), mark rows done on a stop token or at max_tokens,
    advance steps / positions / next tokens; rows past `batch` untouched."""
    from hybridrl.rollout.native.state import DecodeState

    g = torch.Generator().manual_seed(batch)
    slots, max_gen = 320, 12
    states = [DecodeState(slots, 4, max_gen, 32, torch.device(DEVICE)) for _ in range(2)]
    init = dict(
        tokens=torch.randint(0, 50, (slots,), generator=g), positions=torch.randint(0, 60, (slots,), generator=g),
        steps=torch.randint(1, max_gen, (slots,), generator=g), max_lens=torch.randint(2, max_gen + 1, (slots,), generator=g),
        done=torch.rand(slots, generator=g) < 0.3, out_tokens=torch.randint(0, 50, (slots, max_gen + 1), generator=g),
        out_logprobs=torch.randn(slots, max_gen + 1, generator=g),
    )  # fmt: skip
    for st in states:
        for name, value in init.items():
            getattr(st, name).copy_(value.to(DEVICE))
        st.set_stop_ids([3, 7])
    new_tokens = torch.randint(0, 10, (batch,), generator=g).to(DEVICE)  # some 3s and 7s: stops
    logprobs = torch.randn(batch, generator=g).to(DEVICE)
    states[0].advance(batch, new_tokens, logprobs)
    triton_kernels.advance(states[1], batch, new_tokens, logprobs)
    for name in list(init) + ["stop_ids"]:
        assert torch.equal(getattr(states[1], name), getattr(states[0], name)), name


def _decode_step_inputs(g, dtype, hq, hkv, d, nb, mb):
    """One decode step's inputs for 5 rows whose new tokens sit at position 0, mid-block, on a
    block's last and first slots, and deep into the context: (positions, q, k, v as column slices
    of one q|k|v projection (strided rows, as the decoder has them), cos, sin, block tables)."""
    pos = torch.tensor([0, 7, 15, 16, 139], device=DEVICE)
    batch = pos.numel()
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    ang = torch.rand(256, d // 2, generator=g).to(DEVICE) * 6
    bt = torch.randperm(nb - 1, generator=g)[: batch * mb].view(batch, mb).add(1).to(DEVICE, torch.int32)
    return pos, q, k, v, ang.cos(), ang.sin(), bt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(14, 2), (4, 4)])
@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("in_registers, prefetch", [(False, False), (True, False), (True, True)])
def test_rope_decode_attention_in_one_kernel_equals_the_two(dtype, qk_norm, heads, tile, in_registers, prefetch):
    """The fused kernel writes the same K/V into the cache and returns the same attention as
    qk_rope_write_kv followed by paged_decode_attention: new tokens at position 0, mid-block, on a
    block's last and first slots, and deep into the context; q / k / v strided as the decoder has them.
    With the new token attended from registers (after the cached ones: another summation order),
    the same within fp32 rounding, and within one rounding of the output's type; so too with the
    block table read a tile ahead."""
    from hybridrl.rollout.native.ops_triton import TritonOps

    g = torch.Generator().manual_seed(7)
    hq, hkv = heads
    d, bs, nb, mb = 64, 16, 50, 9
    pos, q, k, v, cos, sin, bt = _decode_step_inputs(g, dtype, hq, hkv, d, nb, mb)
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)  # earlier tokens' keys / values
    vc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    scale = d**-0.5
    two = TritonOps(attention_tile=tile, new_token_in_registers=in_registers, prefetch_table=prefetch)
    k2, v2 = kc.clone(), vc.clone()
    rotated = triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, qn, kn, 1e-6, k2, v2, bt)
    want = triton_attention.paged_decode_attention(rotated, k2, v2, bt, pos + 1, scale, tile=tile)
    k1, v1 = kc.clone(), vc.clone()
    got = two.rope_decode_attention(q, k, v, pos, cos, sin, qn, kn, 1e-6, k1, v1, bt, scale)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    if in_registers and dtype != torch.float32:
        torch.testing.assert_close(got, want, atol=8e-3, rtol=8e-3)  # one bf16 rounding apart
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # and the PyTorch reference of the pair
    k0, v0 = kc.clone(), vc.clone()
    ref = TorchOps().rope_decode_attention(q, k, v, pos, cos, sin, qn, kn, 1e-6, k0, v0, bt, scale)
    torch.testing.assert_close(got, ref, **_tol(dtype))
    torch.testing.assert_close(k1, k0, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_find_the_cache_through_the_address_table(dtype):
    """With kv_table (kv_cache.CacheAddresses), every cache kernel reads and writes the cache the
    table points at, bitwise as when given the cache itself; and after point_at() a new cache at
    another address, the same calls (the same arguments, as a captured graph has them) use the new
    cache and leave the old one alone."""
    from hybridrl.rollout.native.kv_cache import CacheAddresses, PagedKVCache
    from hybridrl.rollout.native.ops_triton import TritonOps

    g = torch.Generator().manual_seed(11)
    layers, hq, hkv, d, bs, nb, mb, layer = 3, 14, 2, 64, 16, 50, 9, 1
    pos, q, k, v, cos, sin, bt = _decode_step_inputs(g, dtype, hq, hkv, d, nb, mb)
    keys = torch.randn(layers, nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    values = torch.randn(layers, nb, hkv, bs, d, generator=g).to(DEVICE, dtype)

    def new_cache():
        cache = PagedKVCache(layers, nb, hkv, bs, d, dtype, torch.device(DEVICE))
        cache.k.copy_(keys)
        cache.v.copy_(values)
        return cache

    def run(cache, kv_table):
        """Each cache op once, on `layer`: outputs, then the cache's K and V."""
        kc, vc = cache.k[layer], cache.v[layer]
        outs = [triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, kv_table=kv_table)]
        for split in (0, 32):
            outs.append(triton_attention.paged_decode_attention(
                outs[0], kc, vc, bt, pos + 1, d**-0.5, tile=16, split_tokens=split, kv_table=kv_table))  # fmt: skip
        for in_registers in (False, True):
            outs.append(TritonOps(attention_tile=16, new_token_in_registers=in_registers, prefetch_table=in_registers)
                        .rope_decode_attention(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, d**-0.5, kv_table=kv_table))  # fmt: skip
        return outs + [cache.k.clone(), cache.v.clone()]

    want = run(new_cache(), None)
    table = CacheAddresses(layers, dtype, torch.device(DEVICE))
    first = new_cache()
    table.point_at(first)
    for got, ref in zip(run(first, table.layer(layer)), want):
        assert torch.equal(got, ref)
    second = new_cache()  # another allocation, while the first is still held
    assert second.k.data_ptr() != first.k.data_ptr()
    table.point_at(second)
    first.k.zero_()
    first.v.zero_()
    # The arguments a graph captured on `first` would replay: first's tensors (for their shapes),
    # the table's anchor and layer row. The kernels must find `second` through the table.
    kc, vc = first.k[layer], first.v[layer]
    anchor, row = table.layer(layer)
    got_q = triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, kv_table=(anchor, row))
    got_attn = triton_attention.paged_decode_attention(got_q, kc, vc, bt, pos + 1, d**-0.5, tile=16, kv_table=(anchor, row))
    assert torch.equal(got_q, want[0]) and torch.equal(got_attn, want[1])
    assert torch.equal(second.k, want[-2]) and torch.equal(second.v, want[-1])
    assert not first.k.any() and not first.v.any()


@needs_runtime_loop_bounds
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("splits", [1, 2, 3, 5, 0])
def test_shared_prefix_attention_equals_per_row_attention(dtype, tile, splits):
    """Cascade attention (rows of a group read their shared prompt blocks together, in `splits`
    chunks of tiles merged afterwards, then their own) gives each row what attending to its whole
    context alone gives. Prefixes of 80 and 32 tokens: with tile 16, 5 and 2 tiles (splits 2 and 3
    divide 5 unevenly, 5 is one chunk per tile, and the 2-tile prefix is capped at 2 chunks); with
    tile 64, 2 and 1 tiles. splits=0: the count SharedPrefix picks for the batch."""
    from hybridrl.rollout.native.scheduler import PromptGroup, RunningSequence
    from hybridrl.rollout.native.shared_prefix import SharedPrefix

    g = torch.Generator().manual_seed(3)
    batch, hq, hkv, d, bs, nb, mb = 8, 14, 2, 64, 16, 48, 9
    q = torch.randn(batch, hq, d, generator=g).to(DEVICE, dtype)
    kc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    vc = torch.randn(nb, hkv, bs, d, generator=g).to(DEVICE, dtype)
    # Rows 0, 2, 3, 5 share blocks 1-5 (80 tokens), rows 1 and 4 share blocks 6-7; row 6 is alone;
    # row 7 is inactive (not running). Every row's own blocks follow its shared ones.
    groups = {0: (PromptGroup(0, [1] * 85, 8, 4, shared_blocks=[1, 2, 3, 4, 5]), [0, 2, 3, 5]),
              1: (PromptGroup(1, [1] * 40, 8, 2, shared_blocks=[6, 7]), [1, 4]),
              2: (PromptGroup(2, [1] * 5, 8, 1, shared_blocks=[]), [6])}  # fmt: skip
    free = iter(range(8, nb))
    table = torch.zeros(batch, mb, dtype=torch.int32)
    running = {}
    for group, rows in groups.values():
        for j, row in enumerate(rows):
            blocks = group.shared_blocks + [next(free) for _ in range(mb - len(group.shared_blocks))]
            table[row] = torch.tensor(blocks, dtype=torch.int32)
            running[row] = RunningSequence(group, j, row)
    bt = table.to(DEVICE)
    ctx = torch.tensor([81, 33, 100, 144, 60, 97, 20, 1], device=DEVICE)
    prefix = SharedPrefix(batch, 4, hq, hkv, d, torch.device(DEVICE), splits=splits)
    assert prefix.update(running, bs) == 2
    assert prefix.row_prefix.tolist() == [80, 32, 80, 80, 32, 80, 0, 0]
    ref = TorchOps().decode_attention(q, kc, vc, bt, ctx, d**-0.5)
    plain = triton_attention.paged_decode_attention(q, kc, vc, bt, ctx, d**-0.5, tile=tile)
    cascade = triton_attention.paged_decode_attention(q, kc, vc, bt, ctx, d**-0.5, tile=tile, prefix=prefix)
    torch.testing.assert_close(cascade, ref, **_tol(dtype))
    torch.testing.assert_close(cascade, plain, **_tol(dtype))
    # The same through an address table (kv_cache.CacheAddresses) pointing at a copy of the cache.
    from hybridrl.rollout.native.kv_cache import CacheAddresses, PagedKVCache

    moved = PagedKVCache(1, nb, hkv, bs, d, dtype, torch.device(DEVICE))
    moved.k[0], moved.v[0] = kc, vc
    table = CacheAddresses(1, dtype, torch.device(DEVICE))
    table.point_at(moved)
    through = triton_attention.paged_decode_attention(
        q, kc.new_zeros(kc.shape), vc.new_zeros(vc.shape), bt, ctx, d**-0.5, tile=tile, prefix=prefix, kv_table=table.layer(0)
    )
    assert torch.equal(through, cascade)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_fused_halves(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    gate, up = gate_up.split([1500, 1500], -1)
    torch.testing.assert_close(triton_kernels.silu_mul(gate, up), TorchOps().silu_mul(gate, up), **_tol(dtype))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampling_matches_reference(temperature):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 9000, generator=g) * 3).to(DEVICE)
    keys = torch.tensor([1, 2, 3, 4, 5, 0xFFFFFFFF], device=DEVICE)
    steps = torch.tensor([0, 1, 7, 100, 5, 3], device=DEVICE)
    params = SamplingParams(temperature=temperature)
    ref_tok, ref_lp = sample(logits, keys, steps, params)
    tok, lp = triton_sampling.sample(logits, keys, steps, params)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize(
    "batch,vocab,chunk",
    [(1, 1000, SAMPLE_CHUNK), (5, 9000, SAMPLE_CHUNK), (13, 30001, SAMPLE_CHUNK), (7, 3000, 256), (3, 1500, 64)],
)
def test_two_level_sampling_matches_reference(temperature, batch, vocab, chunk):
    """The kernel's two-level draw (a chunk by its log-mass, then a token of it) picks the tokens
    sampling.sample picks, for vocabularies that are not a multiple of the chunk and chunk counts
    that are not a power of 2; log-probs are log_softmax over the whole vocabulary."""
    g = torch.Generator().manual_seed(batch * vocab + chunk)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(DEVICE)
    keys = torch.randint(0, 2**32, (batch,), generator=g).to(DEVICE)
    steps = torch.randint(0, 2**31, (batch,), generator=g).to(DEVICE)
    params = SamplingParams(temperature=temperature)
    ref_tok, ref_lp = sample(logits, keys, steps, params, chunk=chunk)
    tok, lp = triton_sampling.sample(logits, keys, steps, params, chunk=chunk)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    exact = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, exact, atol=1e-4, rtol=1e-4)


def test_two_level_sampling_skips_chunks_without_mass_and_ignores_the_batch():
    """Chunks of -inf logits only are never drawn (no NaN); a row's token depends on its own key,
    step and logits, not on the other rows of the batch or their order."""
    g = torch.Generator().manual_seed(5)
    batch, vocab, chunk = 8, 1100, 128
    logits = torch.randn(batch, vocab, generator=g) * 2
    logits[:, 128:512] = float("-inf")  # chunks 1-3
    logits[:, 1024:] = float("-inf")  # the last, partial chunk
    logits = logits.to(DEVICE)
    keys = torch.randint(0, 2**32, (batch,), generator=g).to(DEVICE)
    params = SamplingParams(temperature=1.0)
    for step in range(4):
        steps = torch.full((batch,), step, device=DEVICE)
        tok, lp = triton_sampling.sample(logits, keys, steps, params, chunk=chunk)
        ref_tok, ref_lp = sample(logits, keys, steps, params, chunk=chunk)
        assert torch.equal(tok, ref_tok)
        assert not ((tok >= 128) & (tok < 512)).any() and not (tok >= 1024).any()
        assert torch.isfinite(lp).all()
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
        perm = torch.randperm(batch, generator=g).to(DEVICE)
        tok_perm, _ = triton_sampling.sample(logits[perm], keys[perm], steps[perm], params, chunk=chunk)
        assert torch.equal(tok_perm, tok[perm])
        tok_one, _ = triton_sampling.sample(logits[3:4], keys[3:4], steps[3:4], params, chunk=chunk)
        assert tok_one.item() == tok[3].item()


@needs_runtime_loop_bounds
def test_engine_with_shared_prefix_attention_generates_the_same():
    """The whole engine with the Triton kernels, cascade attention on and off: the same samples
    (same tokens, log-probs within fp32 rounding) for prompts that share one and two full blocks.
    Tiles of 16 tokens, so that the two-block prefix is split over two programs per group."""
    import transformers

    from hybridrl.rollout.native import NativeBackend
    from hybridrl.rollout.native.ops_triton import TritonOps
    from hybridrl.rollout.types import GenerationRequest

    config = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (20, 37, 9)]
    request = GenerationRequest(prompts, n=3, max_tokens=[12] * 3, temperature=1.0, seed=0, stop_token_ids=[])
    outs = {}
    for cascade in (False, True):
        backend = NativeBackend(model, shared_prefix_attention=cascade)
        backend.decoder.ops = TritonOps(attention_tile=16)  # on CPU: Triton's interpreter
        outs[cascade] = backend.generate(request)
        assert (backend.decoder.prefix is not None) == cascade
    assert [o.response_ids for o in outs[True]] == [o.response_ids for o in outs[False]]
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["barrier", "dataflow"])
@pytest.mark.parametrize("split, tma, pair", [(1, False, False), (2, False, True), (4, False, False), (2, True, True)])
def test_bench_decode_persistent_runs_the_layer_chain_in_one_launch(dtype, form, split, tma, pair):
    """bench/decode_persistent.py's kernels: every layer's q|k|v, o_proj, gate|up + SiLU * up and down
    in one launch, with grid barriers between the phases or (dataflow) each tile waiting for the row
    block it reads, down's K split with the partials summed by the last split to finish a tile;
    against the same chain of separate products. Under the interpreter the grid is one program (its
    programs run one after another, so a wait on another program would never end); on a GPU one
    program per SM, most of them with no tile."""
    from conftest import bench_script

    bench = bench_script("decode_persistent")
    g = torch.Generator().manual_seed(3)
    layers, rows, hidden, qkv, inter = 2, 32, 64, 128, 128

    def weight(n, k, gain=1.0):
        return (torch.randn(layers, n, k, generator=g) * (gain / k**0.5)).to(DEVICE, dtype)

    wqkv, wo, wgu, wd = weight(qkv, hidden), weight(hidden, hidden), weight(2 * inter, hidden), weight(hidden, inter, 1.7)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    ref = x
    for i in range(layers):
        o = torch.nn.functional.linear(torch.nn.functional.linear(ref, wqkv[i])[:, :hidden], wo[i])
        gate, up = torch.nn.functional.linear(o, wgu[i]).split([inter, inter], -1)
        ref = torch.nn.functional.linear(TorchOps().silu_mul(gate, up), wd[i])
    blocks = dict(bm_qkv=16, bn_qkv=32, bm_o=16, bn_o=16, bm_gu=16, bn_gu=16, bm_d=16, bn_d=16, bk=16)
    kernel = bench.Persistent(rows, hidden, qkv, inter, layers, wqkv, wo, wgu, wd, **blocks, split=split, tma=tma,
                              form=form, pair=pair, num_stages=2, nprog=1 if DEVICE == "cpu" else None)  # fmt: skip
    y = x.clone()
    kernel.run(y)
    assert not kernel.failed()
    c = kernel.counters.cpu()
    if split > 1:  # every tile of every layer's down product heard from all its splits
        assert (c[2 : kernel.ready_at] == split).all()
    if form == "barrier":
        assert c[0].item() == 4 * layers * kernel.nprog  # every program passed every barrier
    else:  # every row block of every layer counted all the tiles it waited for
        ready = c[kernel.ready_at :].view(layers, rows // 16, 3 + split)
        expect = [hidden // 16, qkv // 32, hidden // 16] + [inter // split // 16] * split
        assert (ready == torch.tensor(expect, dtype=ready.dtype)).all(), ready
    exact = dtype == torch.float32 and DEVICE == "cpu"  # (on a GPU, fp32 products are tf32's)
    tol = dict(atol=1e-4, rtol=1e-4) if exact else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "split, tma, pair, row_major, rows",
    [(1, False, True, False, False), (2, False, False, True, True), (2, True, True, True, False), (2, False, True, False, True)],
)
def test_bench_decode_persistent_runs_the_attention_as_items_of_the_chain(dtype, split, tma, pair, row_major, rows):
    """bench/decode_persistent.py's dataflow kernel with attention items (--attention): between q|k|v and
    o_proj, the engine's rotary + KV write + paged attention (_rope_attend_row) runs as one item per
    (row, KV head), over each layer's own slice of a paged cache whose prompt blocks the samples of a
    prompt share; against the same chain with TorchOps' attention, cache writes included. gate|up's two
    products in one K loop (pair) or one after the other; the items listed phase by phase or (row_major)
    row block by row block; an attention item one (row, KV head) or (rows) a row with all its KV heads."""
    from conftest import bench_script

    bench = bench_script("decode_persistent")
    g = torch.Generator().manual_seed(5)
    layers, batch, heads, kv_heads, dim, inter = 2, 32, 4, 2, 16, 128
    hidden, qkv = heads * dim, (heads + 2 * kv_heads) * dim
    prompts, prompt_len, context, bs = 4, 16, 40, 16

    def weight(n, k, gain=1.0):
        return (torch.randn(layers, n, k, generator=g) * (gain / k**0.5)).to(DEVICE, dtype)

    wqkv, wo, wgu, wd = weight(qkv, hidden), weight(hidden, hidden), weight(2 * inter, hidden), weight(hidden, inter, 1.7)
    x = torch.randn(batch, hidden, generator=g).to(DEVICE, dtype)
    tables, blocks = bench_script("decode_attention").block_tables(prompts, batch // prompts, prompt_len, 48, g)
    k_cache, v_cache = (torch.randn(layers, blocks, kv_heads, bs, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    ang = torch.rand(48, dim // 2, generator=g) * 6
    pos = torch.full((batch,), context - 1, device=DEVICE)
    att = bench.Attention(pos, ang.cos().to(DEVICE), ang.sin().to(DEVICE), k_cache.clone(), v_cache.clone(),
                          tables.to(DEVICE), heads, tile=16)  # fmt: skip
    ops, ref = TorchOps(), x
    for i in range(layers):
        q, k, v = torch.nn.functional.linear(ref, wqkv[i]).split([hidden, kv_heads * dim, kv_heads * dim], -1)
        attn = ops.rope_decode_attention(q, k, v, pos, att.cos, att.sin, None, None, 1e-6, k_cache[i], v_cache[i],
                                         att.block_tables, dim**-0.5)  # fmt: skip
        gate, up = torch.nn.functional.linear(torch.nn.functional.linear(attn, wo[i]), wgu[i]).split([inter, inter], -1)
        ref = torch.nn.functional.linear(ops.silu_mul(gate, up), wd[i])
    kernel = bench.Persistent(batch, hidden, qkv, inter, layers, wqkv, wo, wgu, wd, bm_qkv=16, bn_qkv=32, bm_o=16,
                              bn_o=16, bm_gu=16, bn_gu=16, bm_d=16, bn_d=16, bk=16, split=split, tma=tma, pair=pair,
                              form="dataflow", attention=att, row_major=row_major, attention_rows=rows, num_stages=2,
                              nprog=1 if DEVICE == "cpu" else None)  # fmt: skip
    y = x.clone()
    kernel.run(y)
    assert not kernel.failed()
    # every row block of every layer counted all it waited for: down tiles, q|k|v tiles, o_proj tiles,
    # attention items (16 rows, x 2 KV heads unless an item is a row), gate|up tiles per down split
    ready = kernel.counters.cpu()[kernel.ready_at :].view(layers, batch // 16, 4 + split)
    expect = [hidden // 16, qkv // 32, hidden // 16, 16 * (1 if rows else kv_heads)] + [inter // split // 16] * split
    assert (ready == torch.tensor(expect, dtype=ready.dtype)).all(), ready
    tol = _tol(dtype) if DEVICE == "cpu" else dict(atol=2e-2, rtol=2e-2)  # (GPU: tf32 / bf16 products in another order)
    torch.testing.assert_close(kernel.attn.float(), attn.float(), **tol)  # the last layer's attention
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    # the new token's key and value went into every layer's cache, as the reference wrote them
    torch.testing.assert_close(att.k_cache.float(), k_cache.float(), **tol)
    torch.testing.assert_close(att.v_cache.float(), v_cache.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [(16, 32, 32, 32), (16, 16, 64, 16)])
def test_bench_decode_mlp_is_the_four_kernel_mlp_in_one(dtype, blocks):
    """bench/decode_mlp.py's fused kernel: down(silu(x @ gate.T) * (x @ up.T)) added into an fp32
    output, rows not a multiple of the row block, several intermediate slices adding into one row."""
    from conftest import bench_script

    bench = bench_script("decode_mlp")
    g = torch.Generator().manual_seed(2)
    rows, hidden, inter = 20, 64, 96
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    gate_up = (0.1 * torch.randn(2 * inter, hidden, generator=g)).to(DEVICE, dtype)
    down = (0.1 * torch.randn(hidden, inter, generator=g)).to(DEVICE, dtype)
    gate, up = torch.nn.functional.linear(x, gate_up).split([inter, inter], -1)
    ref = torch.nn.functional.linear(TorchOps().silu_mul(gate, up), down).float()
    start = torch.randn(rows, hidden, generator=g).to(DEVICE)  # the kernel adds into what is there
    bm, bi, bk, bn = blocks
    out = bench.fused_mlp(x, gate_up, down, start.clone(), block_m=bm, block_i=bi, block_k=bk, block_n=bn, num_stages=2)
    tol = dict(atol=1e-2, rtol=1e-2) if (dtype == torch.float32 and DEVICE == "cuda") else _tol(dtype)
    torch.testing.assert_close(out - start, ref, **tol)


@needs_runtime_loop_bounds
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("kind", ["pointer", "tma", "tma-wg"])
def test_bench_decode_fusion_folds_the_rms_norm_into_the_product(dtype, swiglu, kind):
    """bench/decode_fusion.py's kernels: rms_norm(x) * g @ W.T (+ b), or silu(gate) * up of it, with
    the norm applied as rstd * ((x * g) @ W.T); tiles through tl.load or TMA, g applied to x or
    folded into W beforehand."""
    from conftest import bench_script

    bench = bench_script("decode_fusion")
    g = torch.Generator().manual_seed(1)
    rows, hidden, out_n = 20, 128, 96
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    gain = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    w = (0.05 * torch.randn(2 * out_n if swiglu else out_n, hidden, generator=g)).to(DEVICE, dtype)
    b = None if swiglu else (0.1 * torch.randn(out_n, generator=g)).to(DEVICE, dtype)
    h, _ = TorchOps().add_rms_norm(x, None, gain, 1e-6)
    ref = torch.nn.functional.linear(h, w, b)
    if swiglu:
        gate, up = ref.split([out_n, out_n], -1)
        ref = TorchOps().silu_mul(gate, up)
    if kind == "pointer":
        out = bench.norm_linear(x, gain, w, b, 1e-6, swiglu=swiglu, cfg=(16, 32, 64, 4, 2))
    else:
        w_in = w if kind == "tma" else (w.float() * gain.float()).to(dtype)
        out = bench.norm_linear_tma(x, gain, w_in, b, 1e-6, swiglu=swiglu, cfg=(16, 32, 64, 4, 3), fold_g=kind == "tma")
    # fp32 products run in TF32 on a GPU (tl.dot's default): ~1e-3 apart over these 128-long sums
    tol = dict(atol=1e-2, rtol=1e-2) if (dtype == torch.float32 and DEVICE == "cuda") else _tol(dtype)
    torch.testing.assert_close(out, ref, **tol)
