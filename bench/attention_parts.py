"""The attention of one packed training micro-batch (W0.5B: three prompt groups, each a 256-token
prompt and 8 responses of 512 tokens; 14 query heads, 2 KV heads, head dim 64), timed three ways
on one GPU:

- the trainer's kernel: one variable-length FlashAttention-2 call, each response's keys being its
  prompt's keys gathered in front of its own (train/attention.py);
- dense parts, through SDPA's cuDNN and flash backends: each response's own causal square, each
  group's responses against its prompt (not causal), and the prompts' causal squares (the three
  results would still have to be merged by their log-sum-exps);
- each response against [its prompt | itself] as one dense product with a lower-right causal mask.

    python bench/attention_parts.py

Forward and forward + backward in microseconds (mean of 30 after 5 warm-up calls) and TFLOP/s over
the micro-batch's causal FLOPs. Dense shapes need equal lengths: the parts only fit this workload,
whose random model always runs to the length limit.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

H, HKV, D = 14, 2, 64  # query heads, KV heads, head dim (Qwen2.5-0.5B)
GROUPS, N, P, R = 3, 8, 256, 512  # prompt groups per micro-batch, responses per prompt, prompt / response tokens
SCALE = D**-0.5
# Causal multiply-adds x 4 (two products, 2 FLOPs each): responses over prompt + own triangle, prompts' triangles.
FLOPS = 4 * D * H * (GROUPS * N * (R * P + R * R / 2) + GROUPS * P * P / 2)


def bench(fn, reps: int = 30) -> float:
    """Mean milliseconds per call on the GPU's clock, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def report(name: str, fwd_ms: float, fwd_bwd_ms: float | None = None) -> None:
    line = f"{name:48s} fwd {fwd_ms * 1e3:8.1f} us ({FLOPS / fwd_ms / 1e9:6.1f} TF/s)"
    if fwd_bwd_ms is not None:  # the backward does 2.5x the forward's products
        line += f"  fwd+bwd {fwd_bwd_ms * 1e3:8.1f} us ({3.5 * FLOPS / fwd_bwd_ms / 1e9:6.1f} TF/s)"
    print(line, flush=True)


def varlen_segments(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seq_q, cu_seq_k and the gathered key positions of the packed row, as packing.py lays them out."""
    cu_q, cu_k, index = [0], [0], []
    for g in range(GROUPS):
        base = g * (P + N * R)
        cu_q.append(cu_q[-1] + P)
        cu_k.append(cu_k[-1] + P)
        index += range(base, base + P)
        for i in range(N):
            cu_q.append(cu_q[-1] + R)
            cu_k.append(cu_k[-1] + P + R)
            index += [*range(base, base + P), *range(base + P + i * R, base + P + (i + 1) * R)]
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_int32(cu_q), as_int32(cu_k), torch.tensor(index, device=device)


def split(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, h, D]` packed -> prompts `[GROUPS, h, P, D]`, responses `[GROUPS * N, h, R, D]`."""
    t = t.view(GROUPS, P + N * R, heads, D)
    return t[:, :P].transpose(1, 2), t[:, P:].reshape(GROUPS * N, R, heads, D).transpose(1, 2)


def main() -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    T = GROUPS * (P + N * R)
    q = torch.randn(T, H, D, device=device, dtype=dtype)
    k_row, v_row = (torch.randn(T, HKV, D, device=device, dtype=dtype) for _ in range(2))

    # The trainer's kernel: one varlen FlashAttention-2 call over the gathered keys.
    cu_q, cu_k, index = varlen_segments(device)
    k, v = k_row[index], v_row[index]
    forward = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, R, P + R, 0.0, True, False, scale=SCALE)  # noqa: E731
    grad_out = torch.randn_like(forward()[0])

    def forward_backward():
        out, lse, seed, offset, _ = forward()
        return torch.ops.aten._flash_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, R, P + R, 0.0, True, seed, offset, scale=SCALE)

    report("varlen FA2 (current, gathered keys)", bench(forward), bench(forward_backward))

    # Dense parts of the same tensors (KV heads repeated for their query heads).
    repeat = lambda t: t.repeat_interleave(H // HKV, dim=1).contiguous()  # noqa: E731
    q_prompt, q_resp = (t.contiguous() for t in split(q, H))
    k_prompt, k_resp = (repeat(t) for t in split(k_row, HKV))
    v_prompt, v_resp = (repeat(t) for t in split(v_row, HKV))
    q_group = q_resp.view(GROUPS, N, H, R, D).transpose(1, 2).reshape(GROUPS, H, N * R, D).contiguous()  # a group's responses as one block
    sdpa = F.scaled_dot_product_attention
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                parts = [
                    ("  own causal [24,14,512]", lambda a, b, c: sdpa(a, b, c, is_causal=True, scale=SCALE), (q_resp, k_resp, v_resp)),
                    ("  x prompt [3,14,4096]x256", lambda a, b, c: sdpa(a, b, c, scale=SCALE), (q_group, k_prompt, v_prompt)),
                    ("  prompt causal [3,14,256]", lambda a, b, c: sdpa(a, b, c, is_causal=True, scale=SCALE), (q_prompt, k_prompt, v_prompt)),
                ]
                leaves = [[t.detach().requires_grad_() for t in args] for _, _, args in parts]

                def all_forward():
                    for _, fn, args in parts:
                        fn(*args)

                def all_forward_backward():
                    outs = [fn(*args) for (_, fn, _), args in zip(parts, leaves)]
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

                report(f"dense parts, {backend.name} (no merge)", bench(all_forward), bench(all_forward_backward))
                for name, fn, args in parts:
                    print(f"{name:48s} fwd {bench(lambda: fn(*args)) * 1e3:8.1f} us", flush=True)  # noqa: B023
        except RuntimeError as e:
            print(backend.name, "failed:", repr(e)[:300], flush=True)

    # Each response over [its prompt | itself] as one dense product, causal from the lower right.
    k_cat = torch.cat([k_prompt.repeat_interleave(N, 0), k_resp], dim=2).contiguous()
    v_cat = torch.cat([v_prompt.repeat_interleave(N, 0), v_resp], dim=2).contiguous()
    mask = causal_lower_right(R, P + R)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                ms = bench(lambda: sdpa(q_resp, k_cat, v_cat, attn_mask=mask, scale=SCALE))
            print(f"{'lower-right dense [24,14,512]x768 ' + backend.name:48s} fwd {ms * 1e3:8.1f} us", flush=True)
        except RuntimeError as e:
            print("lower-right", backend.name, "failed:", repr(e)[:300], flush=True)
    print("cuDNN", torch.backends.cudnn.version())


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench/attention_parts.py needs a CUDA GPU")
    torch.manual_seed(0)
    main()
