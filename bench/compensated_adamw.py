"""Step time and memory of CompensatedAdamW against MasterWeightAdamW on Qwen2.5-0.5B-shaped bf16 parameters.

    python bench/compensated_adamw.py [--scale 0.1] [--device cuda]

Parameters are random tensors of the model's shapes (494M at scale 1; --scale shrinks the widths'
product roughly linearly); gradients are random bf16. Prints ms per step (mean of timed steps
after warm-up), the step's peak extra memory, and the accuracy of clip_grad_norm_ over bf16 grads.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridrl.train.precision import CompensatedAdamW, MasterWeightAdamW


def qwen05_shapes(scale: float) -> list[tuple[int, ...]]:
    vocab, hidden, inter, kv, layers = 151936, 896, 4864, 128, 24
    vocab, inter = max(1, int(vocab * scale)), max(1, int(inter * scale))
    layers = max(1, round(layers * scale)) if scale < 1 else layers
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, hidden),
                   (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    return shapes + [(hidden,)]


def timed(fn, device, warmup=3, steps=10) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-fp32", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the kernels of one CompensatedAdamW step")
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16)) for s in qwen05_shapes(args.scale)]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(torch.bfloat16)
    n = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n / 1e6:.1f}M parameters on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)")

    grads32 = [p.grad.float() for p in params]
    exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads32])).item()
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    print(f"clip_grad_norm_ over bf16 grads: {norm.item():.6g} ({norm.dtype}), fp32 norm {exact:.6g}, rel err {abs(norm.item() - exact) / exact:.2e}")
    del grads32

    opt = CompensatedAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-6)
    opt.step()  # state allocated
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = timed(opt.step, device, steps=args.steps)
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    print(f"CompensatedAdamW: {ms:.1f} ms/step, state {state / n:.2f} B/param, step temporaries {extra:.0f} MiB")
    if args.profile:
        with torch.profiler.profile(acc_events=True) as prof:
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))

    if device.type == "cuda":
        opt.fused = False
        ms = timed(opt.step, device, steps=args.steps)
        print(f"CompensatedAdamW, PyTorch path (fused=False): {ms:.1f} ms/step")
    if not args.skip_fp32:
        del opt
        master = MasterWeightAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-6, fused=device.type == "cuda" or None)
        for p, m in zip(params, master.master_params):
            m.grad = p.grad.float()
        ms = timed(master.step, device, steps=args.steps)
        print(f"MasterWeightAdamW (fp32, {'fused' if device.type == 'cuda' else 'foreach'}): {ms:.1f} ms/step")


if __name__ == "__main__":
    main()
