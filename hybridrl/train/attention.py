"""Attention over packed rows (packing.py): each token sees its own prompt and response only.

Two kernels serve packed rows on CUDA (`train.packed_attention`):
- `flash`: PyTorch's built-in FlashAttention-2 kernel for variable-length segments. The row is cut
  into segments (each prompt, each response); a response's keys are its prompt's keys gathered in
  front of its own (a 256-byte-per-token copy at W0.5B shapes), and causality is counted from the
  bottom right, so response token t sees the whole prompt and its own tokens up to t.
- `flex`: a FlexAttention `BlockMask` over the row: tiles outside every sequence are skipped.
- `triton`: the same segments, forward by a Triton kernel that stacks the query heads of each KV
  head into one tile's rows (triton_varlen.py), backward by PyTorch's FlashAttention-2 from that
  forward's output and log-sum-exp.
- `triton_full`: the same Triton forward, and a Triton backward that walks each key block's rows
  for all the query heads sharing it (dK / dV summed in the program). Correct on an H200, but its
  backward took 1.07-1.34x FlashAttention-2's time there (train/NOTES.md, session 21): opt-in only.
- `fa4`: the same segments through FlashAttention-4's CuTe kernels (`pip install flash-attn-4`;
  Hopper and Blackwell kernels with wgmma / tcgen05, where PyTorch's FlashAttention-2 uses mma.sync).
  Optional: asked for without the package, it is an error that says what to install.
- `cudnn`: the same segments, forward by cuDNN's fused SDPA (cudnn_varlen.py; `pip install
  nvidia-cudnn-frontend`, cuDNN >= 9.6), backward by FlashAttention-2; `cudnn_full`: cuDNN's backward
  too. Correct on an H200; at W0.5B its forward kernel took 0.093 ms a 13k-token micro-batch in a
  profiled step, but each call costs the host ~0.07 ms more than the Triton forward's (0.191 against
  0.120 ms), in a forward pass the host paces, and the step was slower (2.355 against 2.316 s;
  train/NOTES.md, session 41).
  Optional, like fa4.
`auto` takes triton on Hopper (sm90) for head dims 64 and 128, flash elsewhere it runs (an sm80+
GPU, bf16 / fp16, head dim <= 256), else flex. At W0.5B on an H200 the Triton forward took a packed
micro-batch's attention forward from ~0.19 to ~0.12-0.15 ms and the training step from 2.46 to
2.39 s (train/NOTES.md, session 20). On an H200
at W0.5B shapes (bench/flex_attention.py --kernels, 13k packed tokens) flash takes forward + backward
from 1.149 ms to 0.793 ms (its forward alone is slower: 0.201 ms against 0.164 ms); in a profiled
training step the attention kernels went from 435 ms to 175 ms (train/NOTES.md). FlexAttention has
no backward on CPU, so there (`auto`) the mask is a dense `[1, 1, L, L]` boolean handed to SDPA;
`flash` asked for on a CPU runs the same segments through a dense fp32 reference of the kernel (for
tests: it is as slow as the mask). Padded (unpacked) calls are plain SDPA.

The attention implementation of a HF model is looked up by name at every forward, including the
recomputation of a gradient-checkpointed layer during backward, so packing is enabled by switching
the model, once, to an implementation registered here that serves both kinds of call.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridrl.train.packing import PackedLayout

NAME = "hybridrl_packed"
BLOCK = 128  # FlexAttention tile: packed rows are padded to a multiple of it on CUDA
SUPPORTED_BASES = ("sdpa", "eager", NAME)
# FlexAttention tiles for training on CUDA. On an H200 with W0.5B heads (14 query, 2 KV, dim 64) over a
# packed 13k-token micro-batch (bench/flex_attention.py), these forward tiles took the forward from
# 0.251 ms (torch's defaults) to 0.152 ms, forward + backward from 1.183 to 1.08 ms; the backward keeps
# torch's own tiles (num_warps / num_stages here equal its sm90 choice). Outputs differ from the
# defaults' by bf16 rounding only.
FLEX_KERNEL_OPTIONS = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


KERNELS = ("auto", "flash", "flex", "triton", "triton_full", "fa4", "cudnn", "cudnn_full")
VARLEN_KERNELS = ("flash", "triton", "triton_full", "fa4", "cudnn", "cudnn_full")  # the kernels that take VarlenSegments


@dataclass
class VarlenSegments:
    """A packed row's segments for the flash kernel (PackedLayout.cu_seq_q ... max_k), passed to the
    attention function as the `hybridrl_varlen` keyword argument of the model's forward."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    kv_index: torch.Tensor
    kv_copies: torch.Tensor | None  # set in torch's deterministic mode: the keys' gradient is then ordered
    max_q: int
    max_k: int
    kernel: str = "flash"  # "flash" (PyTorch's FlashAttention-2), "triton" / "triton_full" (triton_varlen), "fa4", "cudnn" / "cudnn_full"


@torch.library.custom_op("hybridrl::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out `[Tq, H, D]`, log-sum-exp `[H, Tq]` fp32): attention over variable-length segments,
    causal from the bottom right; q `[Tq, H, D]`, k / v `[Tk, Hkv, D]` (grouped-query attention when
    Hkv < H). `kernel` "flash": PyTorch's own FlashAttention-2; "triton": triton_varlen's forward
    (FlashAttention-2's backward); "triton_full": triton_varlen's forward and backward; "fa4":
    FlashAttention-4's CuTe kernels; "cudnn": cuDNN's fused SDPA forward (cudnn_varlen), FlashAttention-2's backward;
    "cudnn_full": cuDNN's forward and backward, the log-sum-exp laid out `[B, H, S, 1]` for cuDNN's backward
    (nothing else reads it). Off CUDA the same contract runs as a dense reference (`_varlen_reference_*`): tests
    and CPU runs of `train.packed_attention=flash` / `fa4` / `cudnn` go through it.

    A custom op rather than an autograd.Function: compiled code sees one opaque op whose output the
    partitioner may recompute under gradient checkpointing. (Traced through an autograd.Function
    inside a compiled checkpointed region, the kernel's saved tensors were kept for every layer:
    +0.6 GiB at W0.5B with `train.compile_layers_per_graph` > 1.)"""
    if not q.is_cuda:
        return _varlen_reference_forward(q, k, v, cu_q, cu_k, scale)
    if kernel == "fa4":
        from flash_attn.cute.interface import _flash_attn_fwd

        out, lse, *_ = _flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=True, return_lse=True,
        )  # fmt: skip
        return out, lse
    if kernel in ("triton", "triton_full"):
        from hybridrl.train.triton_varlen import varlen_forward

        return varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    if kernel in ("cudnn", "cudnn_full"):
        from hybridrl.train import cudnn_varlen

        return cudnn_varlen.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, lse_layout="padded" if kernel == "cudnn_full" else "flash")
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out, lse


@varlen_attention.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, kernel):
    if kernel == "cudnn_full" and q.is_cuda:
        from hybridrl.train.cudnn_varlen import padded_length, padded_segments

        return torch.empty_like(q), q.new_empty((padded_segments(cu_q), q.shape[1], padded_length(max_q), 1), dtype=torch.float32)
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("hybridrl::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                              scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of `varlen_attention`."""
    if not q.is_cuda:
        return _varlen_reference_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, scale)
    if kernel == "fa4":
        from flash_attn.cute.interface import _flash_attn_bwd

        dq, dk, dv = _flash_attn_bwd(
            q, k, v, out, grad_out.contiguous(), lse, scale, True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k,
        )  # fmt: skip
        return dq, dk, dv
    if kernel == "triton_full":
        from hybridrl.train.triton_varlen import varlen_backward

        return varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)
    if kernel == "cudnn_full":
        from hybridrl.train import cudnn_varlen

        return cudnn_varlen.varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)
    # The kernel's dropout RNG state (seed, offset): without dropout it is not read, so placeholders
    # serve. (Kept from the forward in a global, they were tensors no CUDA graph could account for.)
    seed, offset = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.scale, ctx.kernel = max_q, max_k, scale, kernel


def _varlen_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.scale, ctx.kernel)
    return dq, dk, dv, None, None, None, None, None, None


varlen_attention.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def _varlen_visible(cu_q: torch.Tensor, cu_k: torch.Tensor, Tq: int, Tk: int) -> torch.Tensor:
    """`[Tq, Tk]` True where query i may see key j: the same segment, and j no further from its
    segment's end than i is from its own (causal from the bottom right)."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    qi = torch.arange(Tq, device=cu_q.device)
    kj = torch.arange(Tk, device=cu_k.device)
    seg_q = torch.searchsorted(cu_q, qi, right=True) - 1
    seg_k = torch.searchsorted(cu_k, kj, right=True) - 1
    q_to_end = cu_q[seg_q + 1] - 1 - qi
    k_to_end = cu_k[seg_k + 1] - 1 - kj
    return (seg_q[:, None] == seg_k[None, :]) & (k_to_end[None, :] >= q_to_end[:, None])


def _varlen_scores(q, k_full, cu_q, cu_k, scale):
    """Masked fp32 scores `[H, Tq, Tk]`; `k_full`: the keys expanded to every query head."""
    s = torch.einsum("qhd,khd->hqk", q.float(), k_full) * scale
    return s.masked_fill(~_varlen_visible(cu_q, cu_k, q.shape[0], k_full.shape[0]), float("-inf"))


def _per_query_head(t, num_heads):
    """`[T, Hkv, D]` keys or values as fp32 `[T, H, D]`: each KV head repeated for its query heads."""
    return t.float().repeat_interleave(num_heads // t.shape[1], dim=1)


def _varlen_reference_forward(q, k, v, cu_q, cu_k, scale):
    """(out `[Tq, H, D]`, log-sum-exp `[H, Tq]` fp32) of `varlen_attention`, as dense fp32 attention."""
    H = q.shape[1]
    s = _varlen_scores(q, _per_query_head(k, H), cu_q, cu_k, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), _per_query_head(v, H))
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _varlen_reference_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, scale):
    """(dq, dk, dv) of `_varlen_reference_forward`, from the saved log-sum-exp (as flash does)."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    group = H // Hkv
    k_full, v_full = _per_query_head(k, H), _per_query_head(v, H)
    p = torch.exp(_varlen_scores(q, k_full, cu_q, cu_k, scale) - lse[..., None])  # [H, Tq, Tk]
    do = grad_out.float()
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, v_full)
    delta = (do * out.float()).sum(-1).transpose(0, 1)  # [H, Tq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, k_full) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
    fold = lambda t: t.view(t.shape[0], Hkv, group, D).sum(2)  # noqa: E731  (query heads -> their KV head)
    return dq.to(q.dtype).contiguous(), fold(dk).to(k.dtype).contiguous(), fold(dv).to(v.dtype).contiguous()


class _GatherRows(torch.autograd.Function):
    """`x.index_select(0, index)`, whose gradient is summed copy by copy in a fixed order.

    `copies` `[len(x), M]`: for each row of x, the places in `index` that copy it, ascending, then
    `len(index)` (a zero row) up to M (PackedLayout.kv_copies). index_select's own gradient is
    `index_add_`, which adds with atomics: the order, and so the last bits, change from run to run.
    torch's deterministic mode swaps it for a sorted `index_put_`, which at W0.5B added ~9,700 kernel
    launches a training step (radix sorts, bounds checks), in a phase bound by its host's launches.
    Gathering each row's copies and adding them up is ordered by construction and sums in fp32.
    W0.5B on an H200 with the mode on (train/NOTES.md, session 29): 2.61 s a step against 3.04 s,
    the training phase 1.374 against 1.820 s. It also raises the peak from 6.399 to 6.59 GiB: the
    compiled layer groups keep this function's output, the gathered prompt keys and values, for the
    attention's backward (0.211 GiB of them live at the peak in an allocator snapshot, session 31,
    bench/memory_peak.py), where with index_select none is live there (the gather is made again for
    the backward). With the mode off it was no faster than index_add_, so with the mode off the
    trainer keeps index_select and its atomics (PackedLayout.kv_copies is None)."""

    @staticmethod
    def forward(x, index, copies):
        return x.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad):
        (copies,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return padded[copies].sum(1, dtype=torch.float32).to(grad.dtype), None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, copies: torch.Tensor | None) -> torch.Tensor:
    """`x.index_select(0, index)`; with `copies`, its gradient is ordered (see `_GatherRows`)."""
    if copies is None:
        return x.index_select(0, index)
    return _GatherRows.apply(x, index, copies)


def _flash_varlen_attention(query, key, value, seg: VarlenSegments, scaling: float | None):
    """query `[1, H, L, D]`, key / value `[1, Hkv, L, D]` (HF's layout) -> `[1, L, H, D]`."""
    q = query[0].transpose(0, 1).contiguous()
    k = gather_rows(key[0].transpose(0, 1), seg.kv_index, seg.kv_copies)
    v = gather_rows(value[0].transpose(0, 1), seg.kv_index, seg.kv_copies)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out, _ = varlen_attention(q, k, v, seg.cu_seq_q, seg.cu_seq_k, seg.max_q, seg.max_k, scale, seg.kernel)
    return out[None]


def _half_precision_cuda(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """What both varlen kernels need: a CUDA device, bf16 / fp16, a head dim <= 256 and a multiple of 8."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim <= 256 and head_dim % 8 == 0


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `flash` can run here: PyTorch's FlashAttention-2 kernel needs sm80+ and bf16 / fp16."""
    if not _half_precision_cuda(device, dtype, head_dim):
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def fa4_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `fa4` can run here: the flash-attn-4 package, a Hopper or Blackwell GPU, bf16 / fp16."""
    if not _half_precision_cuda(device, dtype, head_dim):
        return False
    try:  # finding the subpackage imports flash_attn itself, which a broken install can make raise
        if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
            return False
    except Exception:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10, 11)


def triton_forward_preferred(device: torch.device, head_dim: int) -> bool:
    """`auto`'s choice between `triton` and `flash` where flash runs: the Triton forward where it was
    measured faster end to end (an H200, head dims 64 and 128: train/NOTES.md, session 20), flash
    elsewhere."""
    if device.type != "cuda" or head_dim not in (64, 128) or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def _packed_or_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    seg = kwargs.pop("hybridrl_varlen", None)
    if seg is not None:
        return _flash_varlen_attention(query, key, value, seg, scaling), None
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
               kernel_options=FLEX_KERNEL_OPTIONS)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex():
    # Uncompiled, FlexAttention materialises the whole score matrix; compiled it is a fused kernel.
    return torch.compile(flex_attention)


AttentionInterface.register(NAME, _packed_or_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # unpacked calls (e.g. generate) get SDPA's masks


def supports_packing(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) in SUPPORTED_BASES


def enable_packed_attention(model: torch.nn.Module, kernel: str = "auto") -> str:
    """Switches an sdpa / eager model to the implementation that also serves packed rows, and picks
    the kernel for them (`train.packed_attention`); returns the kernel packed rows will use."""
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_BASES:
        raise ValueError(
            f"packed training needs a model with sdpa or eager attention, not {impl!r}: "
            "set model.attn_implementation=sdpa, or train.packing=off"
        )
    if kernel not in KERNELS:
        raise ValueError(f"train.packed_attention must be one of {KERNELS}, not {kernel!r}")
    param = next(model.parameters())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    can_flash = flash_available(param.device, param.dtype, head_dim)
    if kernel in ("flash", "triton", "triton_full", "cudnn") and not can_flash and param.device.type == "cuda":
        raise ValueError(
            f"train.packed_attention={kernel} needs PyTorch's FlashAttention kernel (sm80+ GPU, bf16/fp16, head dim <= 256); "
            f"this model is {param.dtype} with head dim {head_dim} on {torch.cuda.get_device_name(param.device)}: "
            "set train.packed_attention=flex (or auto)"
        )
    if kernel in ("triton", "triton_full") and param.device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"train.packed_attention={kernel} needs the triton package: install it, or set train.packed_attention=flash (or auto)")
    if kernel == "fa4" and not fa4_available(param.device, param.dtype, head_dim) and param.device.type == "cuda":
        raise ValueError(
            f"train.packed_attention=fa4 needs FlashAttention-4 (pip install flash-attn-4), a Hopper or Blackwell GPU "
            f"and a bf16/fp16 model with head dim <= 256; this model is {param.dtype} with head dim {head_dim} on "
            f"{torch.cuda.get_device_name(param.device)}: install it, or set train.packed_attention=flash (or auto)"
        )
    if kernel in ("cudnn", "cudnn_full") and param.device.type == "cuda":
        from hybridrl.train.cudnn_varlen import available as cudnn_available

        if not cudnn_available(param.device, param.dtype, head_dim):
            raise ValueError(
                f"train.packed_attention={kernel} needs the cuDNN frontend (pip install nvidia-cudnn-frontend), cuDNN >= 9.6 as "
                f"PyTorch loads it, an sm80+ GPU and a bf16/fp16 model with head dim <= 128 (a multiple of 8); this model is "
                f"{param.dtype} with head dim {head_dim} on {torch.cuda.get_device_name(param.device)}: install it, or set "
                "train.packed_attention=flash (or auto)"
            )
    if kernel in VARLEN_KERNELS:  # off CUDA their segments run through the dense reference
        chosen = kernel
    elif kernel == "auto" and can_flash:
        chosen = "triton" if triton_forward_preferred(param.device, head_dim) else "flash"
    else:
        chosen = "flex"
    model.config._attn_implementation = NAME
    # Forward passes reach the packed row through the whole model (critics) or its base (log-probs).
    model._hybridrl_packed_kernel = chosen
    getattr(model, model.base_model_prefix, model)._hybridrl_packed_kernel = chosen
    return chosen


def sliding_window(config) -> int | None:
    """The attention window a HF config applies to some layer, or None when every layer sees its
    whole context (Qwen2 declares `layer_types`; Mistral-style configs a bare `sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def check_window(config, longest: int) -> None:
    """Packed rows attend over each whole sequence: refuse sequences longer than a sliding window."""
    window = sliding_window(config)
    if window is not None and longest > window:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than the model's sliding attention window ({window}), which "
            "packed training does not apply: set train.packing=off, or keep prompt + response within the window"
        )


def packed_kernel(base_model: torch.nn.Module) -> str:
    """The kernel `enable_packed_attention` chose for this (base) model; flex when it was not called."""
    return getattr(base_model, "_hybridrl_packed_kernel", "flex")


def packed_forward_inputs(layout: PackedLayout, kernel: str) -> dict:
    """The attention keyword arguments of a forward pass over a packed row: the varlen segments for
    `flash` and `fa4` (the mask argument is then an empty 4-D placeholder that HF passes through untouched;
    off CUDA they run through the dense reference), else `packed_attention_mask(layout)`."""
    if kernel in VARLEN_KERNELS:
        seg = VarlenSegments(layout.cu_seq_q, layout.cu_seq_k, layout.kv_index, layout.kv_copies, layout.max_q, layout.max_k, kernel)
        return {"attention_mask": _placeholder_mask(layout.input_ids.device), "hybridrl_varlen": seg}
    return {"attention_mask": packed_attention_mask(layout)}


@functools.cache
def _placeholder_mask(device: torch.device) -> torch.Tensor:
    return torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)


def sequence_mask(doc: torch.Tensor, branch: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """True where query token q may attend to key token kv: same prompt group (`doc`), not in the
    future, and kv is a prompt token (`branch` 0) or in q's own response."""
    same_doc = doc[q_index] == doc[kv_index]
    visible_branch = (branch[kv_index] == 0) | (branch[kv_index] == branch[q_index])
    return same_doc & (kv_index <= q_index) & visible_branch


def packed_attention_mask(layout: PackedLayout) -> BlockMask | torch.Tensor:
    """A `BlockMask` on CUDA, a dense `[1, 1, L, L]` boolean mask elsewhere."""
    L = layout.length
    device = layout.input_ids.device
    if device.type != "cuda":
        idx = torch.arange(L, device=device)
        return sequence_mask(layout.doc_ids, layout.branch_ids, idx[:, None], idx[None, :])[None, None]
    assert L % BLOCK == 0, "packed rows are padded to a multiple of the FlexAttention block on CUDA"
    return _block_mask(layout, L, device)


def _block_mask(layout: PackedLayout, L: int, device: torch.device) -> BlockMask:
    """Classifies each (query tile, key tile) as empty, full or partial from the dense mask, a few
    query tiles at a time (the whole [L, L] mask would be L^2 bytes)."""
    nb = L // BLOCK
    doc, branch = layout.doc_ids, layout.branch_ids
    kv = torch.arange(L, device=device)
    any_blocks, all_blocks = [], []
    rows_per_slab = max(1, (1 << 26) // (L * BLOCK)) * BLOCK  # ~64 MB of mask per slab
    for start in range(0, L, rows_per_slab):
        q = torch.arange(start, min(L, start + rows_per_slab), device=device)
        dense = sequence_mask(doc, branch, q[:, None], kv[None, :]).view(-1, BLOCK, nb, BLOCK)
        any_blocks.append(dense.any(3).any(1))
        all_blocks.append(dense.all(3).all(1))
    visible, full = torch.cat(any_blocks), torch.cat(all_blocks)
    partial = visible & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return sequence_mask(doc, branch, q_idx, kv_idx)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(L, L))
