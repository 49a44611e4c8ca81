"""FlexAttention on a packed W0.5B micro-batch: forward and forward+backward time per kernel setting.

    python bench/flex_attention.py                 # 16,384-token micro-batch, W0.5B heads
    python bench/flex_attention.py --tokens 32768
    python bench/flex_attention.py --backward      # backward tiles, forward tiles fixed
    python bench/flex_attention.py --kernels       # train.packed_attention: flash, flex (our tiles), triton, fa4, cudnn, cudnn_full (if installed)
    python bench/flex_attention.py --kernels --only flash triton --triton-configs 128:64:4:3 128:128:8:2
    python bench/flex_attention.py --kernels --only flash triton triton_full --triton-bwd-configs 128:64:4:2,64:64:4:2

The micro-batch is laid out as training lays it out (hybridrl/train/packing.py): per prompt group
`[prompt 256 | 8 responses x 512]`, each response seeing its prompt and its own earlier tokens,
and the block mask is the one training builds (hybridrl/train/attention.py). TFLOP/s counts the
(query, key) pairs the mask allows: 4 * pairs * head_dim * query heads (forward), 2.5x that for
backward. GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from types import SimpleNamespace
from unittest.mock import patch

import torch
from torch.nn.attention.flex_attention import flex_attention

from hybridrl.train.attention import BLOCK, FLEX_KERNEL_OPTIONS, _block_mask

CANDIDATES = {
    "default": None,
    "m128_n64_w4_s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "m128_n64_w8_s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "m128_n128_w8_s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "m64_n64_w4_s3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "m128_n32_w4_s4": dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4),
}
# Backward tiles (`bwd_` options; the forward keeps FLEX_KERNEL_OPTIONS' tiles through `fwd_` ones).
# torch's sm90 default for head_dim 64: BLOCK_M1 64, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 64, 8 warps, 3 stages.
_FWD = {"fwd_" + k: v for k, v in FLEX_KERNEL_OPTIONS.items() if not k.startswith(("fwd_", "bwd_"))}
_bwd = lambda m1, n1, m2, n2, w, s: dict(_FWD, bwd_BLOCK_M1=m1, bwd_BLOCK_N1=n1, bwd_BLOCK_M2=m2, bwd_BLOCK_N2=n2, bwd_num_warps=w, bwd_num_stages=s)  # noqa: E731
BWD_CANDIDATES = {
    "current": FLEX_KERNEL_OPTIONS,
    "b64_128_w8_s3": _bwd(64, 128, 128, 64, 8, 3),
    "b64_128_w4_s3": _bwd(64, 128, 128, 64, 4, 3),
    "b64_128_w8_s2": _bwd(64, 128, 128, 64, 8, 2),
    "b64_128_w8_s4": _bwd(64, 128, 128, 64, 8, 4),
    "b32_128_w4_s3": _bwd(32, 128, 128, 32, 4, 3),
    "b64_64_w4_s3": _bwd(64, 64, 64, 64, 4, 3),
    "b32_64_w4_s4": _bwd(32, 64, 64, 32, 4, 4),
    "b128_128_w8_s2": _bwd(128, 128, 128, 128, 8, 2),
}


def layout(tokens: int, prompt: int, n: int, response: int, device) -> tuple[SimpleNamespace, int]:
    doc, branch = [], []
    group = 0
    while len(doc) + prompt + n * response <= tokens:
        doc += [group] * (prompt + n * response)
        branch += [0] * prompt + [b for b in range(1, n + 1) for _ in range(response)]
        group += 1
    real = len(doc)
    pad = -(-max(real, 1) // BLOCK) * BLOCK - real
    doc += [-1] * pad
    branch += [0] * pad
    as_t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    pairs = group * (prompt * (prompt + 1) // 2 + n * (response * prompt + response * (response + 1) // 2))
    return SimpleNamespace(doc_ids=as_t(doc), branch_ids=as_t(branch)), pairs


def timed(fn, repeats: int, rounds: int = 3) -> float:
    """Best of `rounds` means over `repeats` calls, after 3 warm-up calls (compiles, autotuning,
    clocks: a single warm-up call made whichever candidate ran first look twice as slow)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def host_time(fn, calls: int = 20) -> float:
    """Host seconds to issue one call, the GPU idle first (a kernel launched from Python pays its
    argument checks and launch on the host: at ~0.2 ms a forward, 24 layers x 3 calls x 11
    micro-batches would hold a training step's GPU back)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return t


def compare_kernels(args, device) -> dict:
    """flash (varlen segments, keys gathered) against flex (block mask, FLEX_KERNEL_OPTIONS) on the
    row training builds (packing.pack_sequences), as the attention function calls them."""
    from hybridrl.train.attention import VarlenSegments, _flash_varlen_attention
    from hybridrl.train.batch import build_sequence_batch
    from hybridrl.train.packing import pack_sequences

    groups = max(1, args.tokens // (256 + 8 * 512))
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(1, 1000, (256,), generator=g).tolist()
        for _ in range(8):
            prompts.append(prompt)
            responses.append(torch.randint(1, 1000, (512,), generator=g).tolist())
    batch = build_sequence_batch(prompts, responses, pad_id=0)
    flex_layout = pack_sequences(batch, pad_to_multiple=BLOCK).to(device)
    flash_layout = pack_sequences(batch).to(device)
    pairs = groups * (256 * 257 // 2 + 8 * (512 * 256 + 512 * 513 // 2))
    flops = 4 * pairs * args.head_dim * args.heads
    torch.manual_seed(0)
    L = flex_layout.length
    mk = lambda h: torch.randn(1, L, h, args.head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q0, k0, v0 = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
    grad = torch.randn(1, flash_layout.length, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    mask = _block_mask(flex_layout, L, device)
    compiled = torch.compile(flex_attention)
    seg = VarlenSegments(flash_layout.cu_seq_q, flash_layout.cu_seq_k, flash_layout.kv_index, flash_layout.kv_copies,
                         flash_layout.max_q, flash_layout.max_k)
    n = flash_layout.length
    scale = args.head_dim**-0.5

    def run_flex(q, k, v):
        out = compiled(q, k, v, block_mask=mask, enable_gqa=True, scale=scale, kernel_options=FLEX_KERNEL_OPTIONS)
        return out.transpose(1, 2)[:, :n]

    def varlen_runner(kernel):  # the trainer's call, through one train.packed_attention kernel
        seg_kernel = dataclasses.replace(seg, kernel=kernel)
        return lambda q, k, v: _flash_varlen_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], seg_kernel, scale)

    candidates = {"flex": run_flex, **{kernel: varlen_runner(kernel) for kernel in ("flash", "triton", "triton_full", "fa4", "cudnn", "cudnn_full")}}
    env_of = {}  # the tiles a candidate runs with, through the kernels' environment overrides
    for cfg in args.triton_configs:  # the Triton forward with other tiles (its backward is flash's)
        candidates[f"triton{cfg}"], env_of[f"triton{cfg}"] = candidates["triton"], {"HYBRIDRL_VARLEN_TILES": cfg}
    for cfg in args.triton_bwd_configs:  # the Triton backward with other tiles (dq, then dK / dV)
        candidates[f"triton_full{cfg}"], env_of[f"triton_full{cfg}"] = candidates["triton_full"], {"HYBRIDRL_VARLEN_BWD_TILES": cfg}
    results, outs, grads = {}, {}, {}
    for name, fn in candidates.items():
        if args.only and name not in args.only and name not in env_of:
            continue
        q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
        try:
            with patch.dict(os.environ, env_of.get(name, {})):  # the candidate's tiles, restored after
                with torch.no_grad():
                    outs[name] = fn(q, k, v).float()
                fwd = timed(lambda: fn(q.detach(), k.detach(), v.detach()), args.repeats)
                both = timed(lambda: fn(q, k, v).backward(grad), args.repeats)
                host = host_time(lambda: fn(q.detach(), k.detach(), v.detach()))
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)
                grads[name] = [t.grad.float() for t in (q, k, v)]
        except Exception as e:  # a kernel this GPU / build does not have: report and go on
            print(f"{name:6s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        results[name] = {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3, "fwd_tflops": flops / fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / both / 1e12,
                         "fwd_host_ms": host * 1e3}  # fmt: skip
        r = results[name]
        print(f"{name:6s} fwd {r['fwd_ms']:7.3f} ms ({r['fwd_tflops']:5.1f} TFLOP/s)  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms ({r['fwd_bwd_tflops']:5.1f} TFLOP/s)"
              f"  host {r['fwd_host_ms']:.3f} ms a forward call", flush=True)  # fmt: skip
    print(f"{n} packed tokens ({groups} prompt groups), {pairs:,} attended pairs")
    if "flash" in outs:
        for name in outs:
            if name == "flash":
                continue
            diff = (outs[name] - outs["flash"]).abs()
            gdiff = [(a - b).abs().max().item() for a, b in zip(grads[name], grads["flash"])]
            print(f"{name} against flash: max|out diff| {diff.max().item():.2e}, mean {diff.mean().item():.2e}; max|dq, dk, dv diff| "
                  f"{gdiff[0]:.2e}, {gdiff[1]:.2e}, {gdiff[2]:.2e}; time / flash: fwd {results[name]['fwd_ms'] / results['flash']['fwd_ms']:.2f}x, "
                  f"fwd+bwd {results[name]['fwd_bwd_ms'] / results['flash']['fwd_bwd_ms']:.2f}x")
    return {"tokens": n, "pairs": pairs, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", nargs="*", default=None, help="candidate names to run")
    ap.add_argument("--backward", action="store_true", help="sweep the backward tiles (BWD_CANDIDATES) instead")
    ap.add_argument("--kernels", action="store_true", help="compare train.packed_attention's flash and flex kernels")
    ap.add_argument("--triton-configs", nargs="*", default=[], metavar="M:N:WARPS:STAGES",
                    help="with --kernels: also time the Triton forward with these tiles (rows, keys, warps, stages)")
    ap.add_argument("--triton-bwd-configs", nargs="*", default=[], metavar="M:N:W:S,M:N:W:S",
                    help="with --kernels: also time triton_full with these backward tiles (dq kernel, then dK/dV kernel)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.kernels:
        result = compare_kernels(args, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    lay, pairs = layout(args.tokens, 256, 8, 512, device)
    L = lay.doc_ids.shape[0]
    mask = _block_mask(lay, L, device)
    torch.manual_seed(0)
    mk = lambda h: torch.randn(1, L, h, args.head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()  # noqa: E731
    q, k, v = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
    grad = torch.randn(1, args.heads, L, args.head_dim, device=device, dtype=torch.bfloat16)
    flops = 4 * pairs * args.head_dim * args.heads
    torch._dynamo.config.recompile_limit = 64  # one compile per candidate (and per requires_grad), none run eagerly
    compiled = torch.compile(flex_attention)
    results = {}
    reference = None
    for name, opts in (BWD_CANDIDATES if args.backward else CANDIDATES).items():
        if args.only and name not in args.only:
            continue
        kw = dict(block_mask=mask, enable_gqa=True, scale=args.head_dim**-0.5, kernel_options=opts)
        try:
            with torch.no_grad():
                out = compiled(q, k, v, **kw)
            fwd = timed(lambda: compiled(q.detach(), k.detach(), v.detach(), **kw), args.repeats)

            def fwd_bwd():
                compiled(q, k, v, **kw).backward(grad)

            both = timed(fwd_bwd, args.repeats)
        except Exception as e:  # an invalid setting for this GPU: report and go on
            print(f"{name:18s} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            results[name] = {"error": str(e)[:300]}
            continue
        if reference is None:
            reference = out.float()
        diff = (out.float() - reference).abs().max().item()
        results[name] = {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3, "fwd_tflops": flops / fwd / 1e12,
                         "fwd_bwd_tflops": 3.5 * flops / both / 1e12, "max_diff_vs_default": diff}  # fmt: skip
        r = results[name]
        print(f"{name:18s} fwd {r['fwd_ms']:7.3f} ms ({r['fwd_tflops']:5.1f} TFLOP/s)  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms "
              f"({r['fwd_bwd_tflops']:5.1f} TFLOP/s)  max|out - default| {diff:.2e}", flush=True)  # fmt: skip
    print(f"L={L} tokens, {pairs:,} attended pairs, {flops / 1e9:.1f} GFLOP forward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": L, "pairs": pairs, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
