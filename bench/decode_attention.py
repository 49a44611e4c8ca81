"""The decode step's attention at its real shapes, kernel by kernel, on one GPU.

    python bench/decode_attention.py [--size 0.5B] [--contexts 257,512,768]
        [--variants staged,registers,prefetch,two,paged] [--configs 128:4:2,128:4:3]

One decode step of the native engine runs, in each layer, the rotary + KV-write + paged attention
of `rows` sequences (W0.5B: 32 prompts x 8 samples; each group's 256 prompt tokens sit in blocks
its 8 rows share, as the engine's prefix sharing lays them out). Every sequence here is at the same
context length, as in a W0.5B rollout whose responses all run to the limit. Each (variant, config,
context) is timed as the engine runs it: one CUDA graph over every layer's own cache (so the cache
streams from HBM, not L2), best of a few replays, in microseconds per layer.

Variants:
- staged: the fused kernel (`rope_paged_decode_attention`) as the engine runs it by default;
- registers: the same kernel attending the new token from registers (`new_in_registers`);
- prefetch: registers, with each tile's block table entries read a tile ahead (`prefetch_table`);
- two: `qk_rope_write_kv` then `paged_decode_attention`, two launches;
- paged: `paged_decode_attention` alone (queries already rotated; no KV write): the tile loop's cost.

A config is tile:warps:stages, or tile:warps:stages:registers to cap the fused kernel's registers
per thread (ptxas's maxnreg), which bounds how many programs an SM holds at once; the last column
gives each compiled kernel's registers per thread, spilled bytes and shared memory. The `floor`
row is the HBM time of the bytes a layer must read (each distinct cached K/V byte once, at 4.8 TB/s).
"""

from __future__ import annotations

import argparse
import json

import torch

from decode_gemm import HBM_BYTES_PER_S, time_graph  # bench/ is on the path when a bench script runs

SHAPES = {  # (heads, kv heads, head dim, layers)
    "0.5B": (14, 2, 64, 24),
    "1.5B": (12, 2, 128, 28),
}
BLOCK = 16  # the engine's tokens per cache block


def compiled(kernels) -> dict:
    """Every compiled binary of these @triton.jit kernels, by (kernel, specialisation key)."""
    out = {}
    for fn in kernels:
        for device_cache in getattr(fn, "device_caches", {}).values():  # none under the interpreter
            for key, kernel in device_cache[0].items():
                kernel._init_handles()  # loads it, which fills n_regs / n_spills
                out[(fn.__name__, key)] = kernel
    return out


def block_tables(prompts: int, n: int, prompt_len: int, max_ctx: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """[prompts * n, max_ctx / BLOCK] tables: each group's prompt blocks shared by its n rows, every
    row's own blocks after them; block ids in a random order, as a long-running cache hands them out."""
    shared = prompt_len // BLOCK
    own = max_ctx // BLOCK - shared
    total = prompts * (shared + n * own)
    ids = torch.randperm(total, generator=gen).to(torch.int32)
    rows = []
    at = 0
    for _ in range(prompts):
        prefix = ids[at : at + shared]
        at += shared
        for _ in range(n):
            rows.append(torch.cat([prefix, ids[at : at + own]]))
            at += own
    return torch.stack(rows), total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="0.5B")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--contexts", default="257,512,768", help="context lengths (new token included), comma-separated")
    ap.add_argument("--variants", default="staged,registers,prefetch,two,paged")
    ap.add_argument("--configs", default="128:4:2", help="tile:warps:stages, comma-separated")
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args(argv)

    from hybridrl.rollout.native import triton_attention, triton_kernels
    from hybridrl.rollout.native.kv_cache import CacheAddresses, PagedKVCache

    heads, kv_heads, dim, layers = SHAPES[args.size]
    contexts = [int(c) for c in args.contexts.split(",")]
    max_ctx = -(-max(contexts) // BLOCK) * BLOCK
    rows = args.prompts * args.n
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    bt, num_blocks = block_tables(args.prompts, args.n, args.prompt_len, max_ctx, gen)
    bt = bt.to(dev)
    cache = PagedKVCache(layers, num_blocks, kv_heads, BLOCK, dim, dtype, dev)
    cache.k.normal_()
    cache.v.normal_()
    table = CacheAddresses(layers, dtype, dev)
    table.point_at(cache)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=dev, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    ang = torch.rand(max_ctx, dim // 2, device=dev) * 6
    cos, sin = ang.cos(), ang.sin()
    scale = dim**-0.5
    print(f"{args.size}: {rows} rows ({args.prompts} prompts x {args.n}), {heads} / {kv_heads} heads of {dim}, "
          f"{layers} layers, {num_blocks} blocks of {BLOCK}; microseconds per layer, best of 20 graph replays")  # fmt: skip

    def call(variant: str, tile: int, warps: int, stages: int, regs, pos: torch.Tensor, rotated: torch.Tensor):
        def run():
            for layer in range(layers):
                kc, vc, kv = cache.k[layer], cache.v[layer], table.layer(layer)
                if variant in ("staged", "registers", "prefetch"):
                    triton_attention.rope_paged_decode_attention(
                        q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, scale, tile=tile, num_warps=warps,
                        num_stages=stages, kv_table=kv, new_in_registers=variant != "staged",
                        prefetch_table=variant == "prefetch", max_registers=regs,
                    )  # fmt: skip
                elif variant == "two":
                    r = triton_kernels.qk_rope_write_kv(q, k, v, pos, cos, sin, None, None, 1e-6, kc, vc, bt, kv_table=kv)
                    triton_attention.paged_decode_attention(
                        r, kc, vc, bt, pos + 1, scale, tile=tile, num_warps=warps, num_stages=stages, kv_table=kv
                    )
                elif variant == "paged":
                    triton_attention.paged_decode_attention(
                        rotated, kc, vc, bt, pos + 1, scale, tile=tile, num_warps=warps, num_stages=stages, kv_table=kv
                    )
                else:
                    raise SystemExit(f"unknown variant {variant!r}; choose from staged, registers, prefetch, two, paged")

        return run

    results = []
    configs = []
    for c in args.configs.split(","):
        tile, warps, stages, *regs = (int(x) for x in c.split(":"))
        configs.append((tile, warps, stages, regs[0] if regs else None))
    header = "| variant | tile:warps:stages[:regs] | " + " | ".join(f"ctx {c}" for c in contexts) + " | registers, spills, shared |"
    print(header)
    print("|" + " --- |" * (3 + len(contexts)))
    floors = []
    for ctx in contexts:
        distinct = args.prompts * min(ctx, args.prompt_len) + rows * max(0, ctx - args.prompt_len)
        floors.append(distinct * kv_heads * dim * 2 * 2 / HBM_BYTES_PER_S * 1e6)
    print("| floor | | " + " | ".join(f"{f:.2f}" for f in floors) + " | |")
    attention_kernels = (triton_attention._rope_paged_decode_kernel, triton_attention._paged_decode_kernel)
    for variant in args.variants.split(","):
        for tile, warps, stages, regs in configs:
            cells = []
            before = compiled(attention_kernels)
            for ctx in contexts:
                pos = torch.full((rows,), ctx - 1, device=dev, dtype=torch.int64)
                rotated = torch.randn(rows, heads, dim, device=dev, dtype=dtype)
                us = time_graph(call(variant, tile, warps, stages, regs, pos, rotated)) * 1e3 / layers
                cells.append(us)
                results.append(dict(variant=variant, tile=tile, warps=warps, stages=stages, max_registers=regs,
                                    context=ctx, us_per_layer=us))  # fmt: skip
            new = [k for key, k in compiled(attention_kernels).items() if key not in before]
            stats = ", ".join(f"{k.n_regs} / {k.n_spills} / {k.metadata.shared // 1024} KiB" for k in new)
            name = f"{tile}:{warps}:{stages}" + (f":{regs}" if regs else "")
            print(f"| {variant} | {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {stats} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(size=args.size, rows=rows, floors_us=dict(zip(contexts, floors)), results=results), f, indent=1)


if __name__ == "__main__":
    main()
