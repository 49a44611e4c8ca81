"""The trainer's GPU paths: Triton log-prob kernels, packed attention (flash, flex), memory, master weights, offload.

Skipped without a CUDA GPU; the kernel tests also run on CPU under Triton's interpreter
(TRITON_INTERPRET=1 with triton installed).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import transformers

from conftest import interpreter_loops_to_runtime_bounds
from hybridrl.train.attention import enable_packed_attention
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.lm_head import logit_grad_torch, logit_stats_torch, token_logprobs
from hybridrl.train.logprobs import response_logprobs

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inv_temp", [1.0, 1.25])
@pytest.mark.parametrize("grads", ["lp", "ent", "both"])
def test_triton_kernels_match_the_torch_reference(dtype, inv_temp, grads):
    pytest.importorskip("triton")
    from hybridrl.train import triton_logprobs

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    rows, V = 7, 5000 if CUDA else 300  # V spans several kernel blocks (BLOCK_V) on the GPU
    logits = (torch.randn(rows, V, generator=g) * 4).to(device, dtype)
    labels = torch.randint(0, V, (rows,), generator=g).to(device)
    lse, lp, ent = triton_logprobs.logit_stats(logits, labels, inv_temp)
    ref = logit_stats_torch(logits, labels, inv_temp)
    for got, want in zip((lse, lp, ent), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # Written into slices of larger buffers (lm_head's chunks), the rest untouched.
    bufs = [torch.full((rows + 5,), 7.0, device=device) for _ in range(3)]
    triton_logprobs.logit_stats(logits, labels, inv_temp, out=tuple(b[2 : 2 + rows] for b in bufs))
    for buf, want in zip(bufs, ref):
        torch.testing.assert_close(buf[2 : 2 + rows], want, atol=1e-4, rtol=1e-5)
        assert (buf[:2] == 7).all() and (buf[2 + rows :] == 7).all()
    g_lp = torch.randn(rows, generator=g).to(device) if grads in ("lp", "both") else None
    g_ent = torch.randn(rows, generator=g).to(device) if grads in ("ent", "both") else None
    want = logit_grad_torch(logits, labels, ref[0], ref[2], g_lp, g_ent, inv_temp)
    got = triton_logprobs.logit_grad_(logits.clone(), labels, ref[0], ref[2], g_lp, g_ent, inv_temp)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
def test_triton_stats_where_the_row_maximum_moves_across_blocks():
    """The statistics kernel keeps a softmax state per lane and merges them at the end: rows whose
    maximum sits in the first column, the last block, or rises block after block must give the
    reference's log-sum-exp, log-prob and entropy, also with a padded last block."""
    pytest.importorskip("triton")
    from hybridrl.train import triton_logprobs

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    V = 2 * triton_logprobs.STATS_BLOCK_V + 77  # three blocks, the last one padded
    logits = torch.randn(5, V, generator=g, dtype=torch.float64) * 3
    logits[0, 0] = 60.0  # the maximum first: every later element adds below it
    logits[1, -1] = 60.0  # the maximum in the padded last block: every lane rescales
    logits[2] += torch.linspace(-40, 40, V, dtype=torch.float64)  # rising: a new maximum in each block
    logits[3] = -30.0  # all equal
    logits[4, ::2] = -1e4  # half the columns with no weight
    labels = torch.tensor([0, V - 1, V // 2, 5, 1])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(device, dtype)
        got = triton_logprobs.logit_stats(x, labels.to(device), 1.0)
        want = logit_stats_torch(x.double(), labels.to(device), 1.0)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-5)


def _model(dtype):
    config = transformers.Qwen2Config(vocab_size=3000, hidden_size=448, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to("cuda", dtype)


def _batch(num_prompts=3, n=4):
    g = torch.Generator().manual_seed(1)
    prompts, responses = [], []
    for i in range(num_prompts):
        prompt = torch.randint(3, 3000, (100 + 37 * i,), generator=g).tolist()
        for _ in range(n):
            prompts.append(prompt)
            responses.append(torch.randint(3, 3000, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g).tolist())
    return build_sequence_batch(prompts, responses, pad_id=0).to(torch.device("cuda"))


def _fa4_here() -> bool:
    from hybridrl.train.attention import fa4_available

    return CUDA and fa4_available(torch.device("cuda"), torch.bfloat16, 64)


def _cudnn_here() -> bool:
    from hybridrl.train.cudnn_varlen import available

    return CUDA and available(torch.device("cuda"), torch.bfloat16, 64)


@gpu
@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "flex"), (torch.bfloat16, "flex"), (torch.bfloat16, "flash"), (torch.bfloat16, "fa4"),
                                          (torch.bfloat16, "cudnn"), (torch.bfloat16, "cudnn_full")])  # fmt: skip
def test_packed_logprobs_and_gradients_match_padded(dtype, kernel):
    if kernel == "fa4" and not _fa4_here():
        pytest.skip("needs flash-attn-4 and a Hopper or Blackwell GPU")
    if kernel.startswith("cudnn") and not _cudnn_here():
        pytest.skip("needs nvidia-cudnn-frontend and cuDNN >= 9.6")
    model = _model(dtype).train()
    assert enable_packed_attention(model, kernel) == kernel
    batch = _batch()
    params = [p for p in model.parameters()]
    lp_pad, ent_pad = response_logprobs(model, batch, with_entropy=True)
    g_pad = torch.autograd.grad(lp_pad.sum() + ent_pad.sum(), params)
    lp_pack, ent_pack = response_logprobs(model, dataclasses.replace(batch, packed=True), with_entropy=True)
    g_pack = torch.autograd.grad(lp_pack.sum() + ent_pack.sum(), params)
    atol = 2e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(lp_pack, lp_pad, atol=atol, rtol=0)
    torch.testing.assert_close(ent_pack, ent_pad, atol=atol, rtol=0)
    if dtype == torch.float32:
        for a, b in zip(g_pack, g_pad):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    else:  # bf16: mean differences, not the worst element
        assert (lp_pack - lp_pad).abs().sum() / batch.response_mask.sum() < 2e-2


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, -3.0])
def test_scale_kernels_round_as_torch_does(dtype, scale):
    """triton_logprobs.scale_ is `t.mul_(g)` and scale_add_ is `dst.add_(src.mul_(g))`, bit for bit, for
    sizes around the kernels' block edge, with g a 0-dim fp32 tensor on the same device (as autograd
    hands the lm_head's surrogate its incoming gradient; 0.37 is not a bf16 / fp16 number, and PyTorch
    rounds it to the tensor's dtype before multiplying)."""
    pytest.importorskip("triton")
    from hybridrl.train import triton_logprobs

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(3)
    g = torch.tensor(scale, device=device)
    block = triton_logprobs.SCALE_BLOCK
    for n in (1, block - 1, block, 3 * block + 5):
        src = (torch.randn(n, generator=gen) * 3).to(device, dtype)
        dst = (torch.randn(n, generator=gen) * 3).to(device, dtype)
        assert torch.equal(triton_logprobs.scale_(src.clone(), g), src.clone().mul_(g))
        got = triton_logprobs.scale_add_(dst.clone(), src.clone(), g)
        assert torch.equal(got, dst.clone().add_(src.clone().mul_(g)))
    if CUDA:
        t = torch.ones(4, 3, device="cuda", dtype=dtype)
        assert triton_logprobs.scalable(t, g) and not triton_logprobs.scalable(t.t(), g)
        assert not triton_logprobs.scalable(t, g.cpu()) and not triton_logprobs.scalable(t.cpu(), g)


@gpu
def test_gradient_made_in_the_lm_head_forward_matches_the_backwards_in_bf16():
    """response_logprobs_with_grad on the GPU path (bf16, flash, the Triton statistics and gradient
    kernels): the same log-probs and parameter gradients as the two-pass lm_head."""
    from hybridrl.train.logprobs import response_logprobs_with_grad

    model = _model(torch.bfloat16).train()
    enable_packed_attention(model, "flash")
    batch = dataclasses.replace(_batch(), packed=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(batch.response_mask.shape, device="cuda", generator=g) * batch.response_mask
    objective = lambda lp, ent: (a * lp + 0.1 * a * ent).sum() / a.numel()  # noqa: E731
    derivatives = lambda lp, ent, a: (a / a_numel, 0.1 * a / a_numel)  # noqa: E731
    a_numel = a.numel()
    params = list(model.parameters())
    lp, ent = response_logprobs(model, batch, with_entropy=True)
    want = torch.autograd.grad(objective(lp, ent), params)
    lp_f, ent_f, zero = response_logprobs_with_grad(model, batch, derivatives, {"a": a})
    got = torch.autograd.grad(zero, params)
    torch.testing.assert_close(lp_f, lp.detach())
    torch.testing.assert_close(ent_f, ent.detach())
    # Both paths round the same products to bf16, but flash's backward accumulates dQ in a
    # nondeterministic order: a few bf16 units of the largest entry, ~0.5% of a gradient's norm.
    for x, y in zip(got, want):
        x, y = x.float(), y.float()
        assert (x - y).norm() <= 1e-2 * y.norm() + 1e-8
        assert (x - y).abs().max() <= 3e-2 * y.abs().max() + 1e-6


@gpu
def test_log_prob_pass_never_waits_for_the_gpu():
    """A pass without gradients (reference, old policy) over several micro-batches queues its work
    without one host sync: a sync there lets the GPU run dry while the host packs the next row.
    (Packed rows only: transformers' own padded-mask code reads the mask on the host.)"""
    from hybridrl.train.policy import batched_logprobs

    model = _model(torch.bfloat16).eval()
    enable_packed_attention(model, "flash")
    batch = dataclasses.replace(_batch(), packed=True)
    batch.host_view()  # made once per step, when the batch is built
    want, _ = batched_logprobs(model, batch, micro_batch_size=2, temperature=1.0, max_tokens=700)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, _ = batched_logprobs(model, batch, micro_batch_size=2, temperature=1.0, max_tokens=700)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want)


@gpu
def test_phase_timer_times_the_gpu_timeline_without_draining_it():
    from hybridrl.metrics import PhaseTimer

    timer = PhaseTimer(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with timer.phase("step"):
            with timer.phase("matmuls"):
                for _ in range(20):
                    y = x @ x
            with timer.phase("host"):
                time.sleep(0.05)  # the GPU may still be busy with the matmuls meanwhile
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    times = timer.pop()
    assert y.isfinite().all()
    assert times["timing/matmuls"] > 0 and times["timing/host"] >= 0
    # Laid end to end, the phases cover the step (event timestamps: ~us apart).
    assert abs(times["timing/matmuls"] + times["timing/host"] - times["timing/step"]) < 2e-3
    assert times["timing/step"] >= 0.05 - 1e-3  # the host's sleep is on the step's clock too
    assert timer.pop() == {}


@gpu
def test_phase_timer_keeps_each_phases_peak_memory_without_a_sync():
    from hybridrl.metrics import PhaseTimer, memory_metrics

    device = torch.device("cuda")
    timer = PhaseTimer(device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    mib = 2**20
    torch.cuda.set_sync_debug_mode("error")
    try:
        with timer.phase("step"):
            with timer.phase("big"):
                a = torch.empty(512 * mib, dtype=torch.uint8, device="cuda")
                del a
            with timer.phase("small"):
                b = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
                del b
    finally:
        torch.cuda.set_sync_debug_mode("default")
    timer.pop()
    out = memory_metrics(device, timer)
    gib = 2**30
    assert out["memory/peak_allocated_gib/big"] == pytest.approx((base + 512 * mib) / gib, abs=1e-3)
    assert out["memory/peak_allocated_gib/small"] == pytest.approx((base + 64 * mib) / gib, abs=1e-3)
    assert out["memory/peak_allocated_gib/step"] == pytest.approx(out["memory/peak_allocated_gib/big"])
    assert out["memory/peak_allocated_gib"] >= out["memory/peak_allocated_gib/big"]


@gpu
def test_auto_picks_triton_or_flash_for_bf16_and_flex_for_fp32():
    from hybridrl.train.attention import triton_forward_preferred

    cuda = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert triton_forward_preferred(cuda, 64) == hopper and triton_forward_preferred(cuda, 128) == hopper
    assert not triton_forward_preferred(cuda, 96)
    assert enable_packed_attention(_model(torch.bfloat16)) == "flash"  # head dim 32: not measured, flash
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=896, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=14, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    wide = transformers.Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)  # W0.5B's head dim, 64
    assert enable_packed_attention(wide) == ("triton" if hopper else "flash")
    assert enable_packed_attention(_model(torch.float32)) == "flex"
    with pytest.raises(ValueError, match="packed_attention=flex"):
        enable_packed_attention(_model(torch.float32), "flash")


@gpu
def test_flash_is_as_close_to_exact_as_flex_eager_and_compiled():
    """bf16 packed log-probs and gradients with flash (and triton) are as close to the fp32 model's as flex's are,
    eager, in compiled decoder layers and in compiled groups of layers with gradient checkpointing
    (train.compile, train.compile_layers_per_graph), over micro-batches of changing shapes."""
    from hybridrl.train.setup import compile_layers, enable_activation_checkpointing

    shapes = ((3, 4), (2, 3), (4, 2))  # three packed shapes: the compiled layers must follow them
    batches = [dataclasses.replace(_batch(p, n), packed=True) for p, n in shapes]

    def run(model):
        outs = []
        for batch in batches:
            lp, _ = response_logprobs(model, batch)
            grads = torch.autograd.grad(lp.sum(), list(model.parameters()))
            outs.append((lp.float(), torch.cat([g.float().flatten() for g in grads])))
        return outs

    exact = _model(torch.float32).train()
    enable_packed_attention(exact, "flex")
    truth = run(exact)
    errors = {}
    for kernel in ("flex", "flash", "triton"):
        for compiled in (0, 1, 2):  # eager, one graph per layer, two layers per graph
            model = _model(torch.bfloat16).train()
            assert enable_packed_attention(model, kernel) == kernel
            if compiled == 2:
                enable_activation_checkpointing(model)
            if compiled:
                compile_layers(model, compiled)
            errs = []
            for (lp, g), (lp_t, g_t), batch in zip(run(model), truth, batches):
                mask = batch.response_mask
                errs.append((((lp - lp_t).abs() * mask).sum().item() / mask.sum().item(), ((g - g_t).norm() / g_t.norm()).item()))
            errors[(kernel, compiled)] = errs
    for compiled in (0, 1, 2):
        for kernel in ("flash", "triton"):
            for (lp_k, g_k), (lp_flex, g_flex) in zip(errors[(kernel, compiled)], errors[("flex", compiled)]):
                assert lp_flex < 5e-2 and g_flex < 5e-2, errors  # flex itself within bf16 rounding of exact
                assert lp_k < 1.5 * lp_flex + 1e-3, errors
                assert g_k < 1.5 * g_flex + 1e-3, errors


@gpu
def test_logprob_phase_memory_does_not_grow_with_tokens_times_vocab():
    """Peak memory of forward + backward over N tokens at a 152k vocabulary: full logits would be
    N x V x 4 bytes (9.3 GiB at N = 16k); the chunked phase stays near one chunk of logits."""
    V, H, chunk = 151936, 896, 1024
    weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    peaks = {}
    for N in (4096, 16384):
        hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, V, (N,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, ent = token_logprobs(hidden, weight, None, labels, chunk=chunk)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peaks[N] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del hidden, lp, ent
        weight.grad = None
    full_logits_gib = 16384 * V * 4 / 2**30
    assert peaks[16384] < 1.5, peaks  # one chunk of bf16 logits (0.3 GiB) + the weight's gradient (0.25 GiB)
    assert peaks[16384] - peaks[4096] < 0.2, peaks  # 4x the tokens: only the [N, H] tensors grow
    assert peaks[16384] < full_logits_gib / 6


@gpu
def test_master_weights_are_fused_adamw_on_gpu():
    from hybridrl.train.optim import build_optimizer
    from hybridrl.train.precision import MasterWeightAdamW

    model = _model(torch.bfloat16)
    opt = build_optimizer(model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    assert isinstance(opt, MasterWeightAdamW) and opt.defaults["fused"]
    response_logprobs(model, _batch(1, 2))[0].sum().backward()
    opt.step()
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(p, m.to(torch.bfloat16))


@gpu
def test_reference_offload_moves_weights_to_pinned_host_memory():
    from hybridrl.train.reference import OffloadedWeights, weights_on_device

    model = _model(torch.bfloat16).eval().requires_grad_(False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offloaded = OffloadedWeights(model)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    assert torch.cuda.memory_allocated() < before
    batch = _batch(1, 2)
    with weights_on_device(offloaded):
        assert all(p.device.type == "cuda" for p in model.parameters())
        want = response_logprobs(model, batch)[0]
    assert all(p.device.type == "cpu" for p in model.parameters())
    # A prefetch (side-stream copy) gives the same weights to the same pass.
    offloaded.prefetch()
    with weights_on_device(offloaded):
        assert all(p.device.type == "cuda" for p in model.parameters())
        got = response_logprobs(model, batch)[0]
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not offloaded.prefetched  # the pass took the prefetched copy
    assert all(flat.is_pinned() for flat in offloaded.flat.values())


@gpu
def test_streamed_reference_weights_give_the_same_pass_without_a_host_sync():
    """Streamed (train.stream_reference): prefetch() sends the embedding only, the pass sends the
    rest when it begins and waits for each layer group's weights on the GPU, not on the host."""
    from hybridrl.train.policy import batched_logprobs
    from hybridrl.train.reference import OffloadedWeights, weights_on_device
    from hybridrl.train.setup import LayerGroup

    def grouped_model():
        model = _model(torch.bfloat16).eval().requires_grad_(False)
        enable_packed_attention(model, "flash")
        layers = model.model.layers
        model.model._hybridrl_layer_groups = [LayerGroup(list(layers[:2])), LayerGroup(list(layers[2:]))]
        return model

    model = grouped_model()
    batch = dataclasses.replace(_batch(), packed=True)
    batch.host_view()
    want, _ = batched_logprobs(model, batch, micro_batch_size=2, temperature=1.0, max_tokens=700)
    offloaded = OffloadedWeights(model, streamed=True)
    assert offloaded.gated()
    for _ in range(2):  # the second time re-records the same events
        torch.cuda.synchronize()
        offloaded.prefetch()
        assert offloaded._issued == 1  # the embedding: the layers wait for the pass
        torch.cuda.set_sync_debug_mode("error")
        try:
            with weights_on_device(offloaded):
                # The layers go once the pass has queued its own inputs: copies to the GPU run in issue order.
                assert offloaded._issued == 1 and model.model._hybridrl_weights_gate.ready == -1
                got, _ = batched_logprobs(model, batch, micro_batch_size=2, temperature=1.0, max_tokens=700)
                assert offloaded._issued == len(offloaded.stages)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not hasattr(model.model, "_hybridrl_weights_gate")
        assert all(p.device.type == "cpu" for p in model.parameters())
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    model = grouped_model()
    unstreamed = OffloadedWeights(model, streamed=False)  # all at once, waited for before the pass
    unstreamed.prefetch()
    assert unstreamed._issued == len(unstreamed.stages)
    with weights_on_device(unstreamed):
        assert not hasattr(model.model, "_hybridrl_weights_gate")
        got, _ = batched_logprobs(model, batch, micro_batch_size=2, temperature=1.0, max_tokens=700)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@gpu
def test_fp32_residual_on_both_sides_narrows_the_rollout_trainer_gap():
    """bf16, 12 layers, packed trainer vs native rollout (W0.5B: 1.0e-2 -> 6.6e-3,
    bench/logprob_parity.py). The trainer with an fp32 stream is also closer to the fp32 model."""
    import copy

    from hybridrl.models.synthetic import random_model
    from hybridrl.rollout.native import NativeBackend
    from hybridrl.rollout.types import GenerationRequest
    from hybridrl.train.residual import enable_fp32_residual

    model = random_model("tiny", "cuda", hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)  # fmt: skip
    exact = copy.deepcopy(model).float()
    enable_packed_attention(exact)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 4096, (8, 64), generator=g).tolist()
    request = GenerationRequest(prompts, n=4, max_tokens=[128] * 8, temperature=1.0, seed=0, stop_token_ids=[])
    result = {}
    for wide in (False, True):
        trainer = copy.deepcopy(model)
        if wide:
            enable_fp32_residual(trainer)
        enable_packed_attention(trainer)
        outs = NativeBackend(copy.deepcopy(model), fp32_residual=wide).generate(request)
        batch = build_sequence_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs], 0)
        batch.packed = True
        batch = batch.to(torch.device("cuda"))
        rollout = torch.tensor([o.response_logprobs for o in outs], device="cuda")
        with torch.no_grad():
            lp = response_logprobs(trainer, batch)[0].float()
            truth = response_logprobs(exact, batch)[0].float()
        result[wide] = ((lp - rollout).abs().mean().item(), (lp - truth).abs().mean().item())
    (gap_narrow, err_narrow), (gap_wide, err_wide) = result[False], result[True]
    assert err_wide < 0.85 * err_narrow, result
    assert gap_wide < 0.85 * gap_narrow, result


def _assert_kernels_match_flash(batch, kernels, label=None):
    """Each of `kernels` against flash through the model on the packed `batch`: the same log-probs (mean over
    response tokens within 2e-3) and parameter gradients (within 2% of each norm) up to bf16 rounding (flash's
    own backward differs from itself by ~0.5% of a gradient's norm)."""
    results = {}
    for kernel in ("flash", *kernels):
        model = _model(torch.bfloat16).train()
        assert enable_packed_attention(model, kernel) == kernel
        lp, ent = response_logprobs(model, batch, with_entropy=True)
        grads = torch.autograd.grad(lp.sum() + ent.sum(), list(model.parameters()))
        results[kernel] = (lp.detach().float(), [g.float() for g in grads])
    lp_a, g_a = results["flash"]
    mask = batch.response_mask.bool()
    for kernel in kernels:
        lp_b, g_b = results[kernel]
        assert (lp_a - lp_b)[mask].abs().mean() < 2e-3, (label, kernel)
        for x, y in zip(g_b, g_a):
            assert (x - y).norm() <= 2e-2 * y.norm() + 1e-8, (label, kernel)


@gpu
def test_fa4_matches_flash_on_the_packed_segments():
    """train.packed_attention=fa4 against flash: the same log-probs and gradients up to bf16 rounding."""
    if not _fa4_here():
        pytest.skip("needs flash-attn-4 and a Hopper or Blackwell GPU")
    _assert_kernels_match_flash(dataclasses.replace(_batch(), packed=True), ("fa4",))


def _segments(lengths):
    """cu_q, cu_k (int32) of segments given as (queries, keys) pairs, and the longest of each."""
    cu_q = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in lengths]).cumsum(0).to(torch.int32)
    return cu_q, cu_k, max(q for q, _ in lengths), max(k for _, k in lengths)


def _varlen_case(dtype, heads, kv_heads, head_dim, dynamic_loop, seed):
    """A varlen kernel test's inputs, or a skip where it cannot run: q, k, v, dout, cu_q, cu_k,
    max_q, max_k, scale. fp32 (the interpreter's case): prompt segments (as many keys as queries),
    response segments (their prompt's keys in front), a segment shorter than a tile, a one-token
    segment; bf16 (GPU only): W0.5B-sized segments, whose row blocks span tiles of keys both
    unmasked and masked."""
    pytest.importorskip("triton")
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's interpreter runs the fp32 case")
    if dynamic_loop and not CUDA and not interpreter_loops_to_runtime_bounds():
        pytest.skip("loops to a run-time bound need numpy < 2.4 under Triton 3.6's interpreter")
    device = "cuda" if CUDA else "cpu"
    lengths = [(40, 40), (23, 63), (1, 41), (70, 110), (5, 5)] if dtype == torch.float32 else [(256, 256), (512, 768), (77, 333), (1, 1)]
    cu_q, cu_k, max_q, max_k = _segments(lengths)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(device, dtype)
    dout = torch.randn(int(cu_q[-1]), heads, head_dim, generator=g).to(device, dtype)
    return q, k, v, dout, cu_q.to(device), cu_k.to(device), max_q, max_k, head_dim**-0.5


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (4, 4, 32), (6, 2, 24)])
@pytest.mark.parametrize("dynamic_loop", [True, False])
def test_triton_varlen_forward_matches_the_reference(dtype, heads, kv_heads, head_dim, dynamic_loop):
    """The Triton varlen forward (`train.packed_attention=triton`) against the dense reference of
    the kernel contract: output and log-sum-exp, on `_varlen_case`'s segments, with GQA and with a
    head dim that is not a power of two."""
    q, k, v, _, cu_q, cu_k, max_q, max_k, scale = _varlen_case(dtype, heads, kv_heads, head_dim, dynamic_loop, seed=0)
    from hybridrl.train.attention import _varlen_reference_forward
    from hybridrl.train.triton_varlen import varlen_forward

    config = (32, 16, 4, 1) if not CUDA else None  # small tiles: several blocks and key tiles per segment
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, config=config, dynamic_loop=dynamic_loop)
    ref_out, ref_lse = _varlen_reference_forward(q.float(), k.float(), v.float(), cu_q, cu_k, scale)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=0)
    if CUDA and dtype == torch.bfloat16:  # the layout FlashAttention-2's backward will read
        _, flash_lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        assert flash_lse.shape == lse.shape
        torch.testing.assert_close(lse, flash_lse, atol=atol, rtol=0)


@gpu
def test_triton_forward_with_flash_backward_matches_flash():
    """train.packed_attention=triton (the Triton forward, FlashAttention-2's backward fed its output
    and log-sum-exp) and triton_full (Triton's backward too) against flash: the same log-probs and
    gradients up to bf16 rounding."""
    pytest.importorskip("triton")
    _assert_kernels_match_flash(dataclasses.replace(_batch(), packed=True), ("triton", "triton_full"))


def _assert_no_further_from_reference_than_flash(grads, ref, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):
    """Each of `grads` (dq, dk, dv) finite and no further from the fp32 reference gradients `ref` than
    FlashAttention-2's backward from the same output and `[H, Tq]` log-sum-exp, up to bf16 rounding."""
    seed, offset = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    flash = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    for name, got, want, ref_grad in zip("qkv", grads, flash, ref):
        assert torch.isfinite(got).all(), name
        err, flash_err = (got.float() - ref_grad).norm(), (want.float() - ref_grad).norm()
        assert err <= 1.5 * flash_err + 1e-3 * ref_grad.norm(), (name, err.item(), flash_err.item())


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (4, 4, 32), (6, 2, 24)])
@pytest.mark.parametrize("dynamic_loop", [True, False])
def test_triton_varlen_backward_matches_the_reference(dtype, heads, kv_heads, head_dim, dynamic_loop):
    """The Triton varlen backward (`train.packed_attention=triton_full`) against the dense reference's
    gradients from the same output and log-sum-exp, on the forward test's segments; on the GPU also
    against FlashAttention-2's backward."""
    if CUDA and not dynamic_loop:
        pytest.skip("on a GPU the kernels loop to run-time bounds; their constant-span form (the interpreter's) "
                    "takes minutes to compile there")
    q, k, v, dout, cu_q, cu_k, max_q, max_k, scale = _varlen_case(dtype, heads, kv_heads, head_dim, dynamic_loop, seed=1)
    from hybridrl.train.attention import _varlen_reference_backward, _varlen_reference_forward
    from hybridrl.train.triton_varlen import varlen_backward

    out, lse = _varlen_reference_forward(q, k, v, cu_q, cu_k, scale)
    configs = ((32, 16, 4, 1), (16, 16, 4, 1)) if not CUDA else None
    grads = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, configs=configs, dynamic_loop=dynamic_loop)
    ref = _varlen_reference_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, cu_q, cu_k, scale)
    for name, got, want in zip("qkv", grads, ref):
        tol = 2e-4 * want.abs().max().item() if dtype == torch.float32 else 3e-2 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
    if CUDA and dtype == torch.bfloat16:
        _assert_no_further_from_reference_than_flash(grads, ref, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)


@gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (12, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("lengths", ["w05b", "mixed", "padded_batch"])
def test_cudnn_varlen_matches_the_reference(heads, kv_heads, head_dim, lengths):
    """cuDNN's forward and backward (cudnn_varlen: train.packed_attention=cudnn / cudnn_full) against the dense
    fp32 reference of the kernel contract, and no further from it than FlashAttention-2: W0.5B-sized segments,
    short and one-token segments, and a segment count that cuDNN's graphs see padded with empty segments. Both
    log-sum-exp layouts: FlashAttention-2's `[H, Tq]` (equal to its own) and the padded one cuDNN's backward reads."""
    if not _cudnn_here():
        pytest.skip("needs nvidia-cudnn-frontend and cuDNN >= 9.6")
    from hybridrl.train import cudnn_varlen
    from hybridrl.train.attention import _varlen_reference_backward, _varlen_reference_forward

    segments = {
        "w05b": [(256, 256)] + [(512, 768)] * 8,
        "mixed": [(40, 40), (23, 63), (1, 41), (70, 110), (5, 5), (300, 556), (1, 1), (64, 64)],
        "padded_batch": [(77, 333), (130, 130), (2, 99)],  # 3 segments, seen as 8
    }[lengths]
    cu_q, cu_k, max_q, max_k = _segments(segments)
    g = torch.Generator().manual_seed(3)
    mk = lambda n, h: torch.randn(n, h, head_dim, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v = mk(int(cu_q[-1]), heads), mk(int(cu_k[-1]), kv_heads), mk(int(cu_k[-1]), kv_heads)
    dout = mk(int(cu_q[-1]), heads)
    cu_q, cu_k, scale = cu_q.cuda(), cu_k.cuda(), head_dim**-0.5
    out_flash_layout, lse_flash_layout = cudnn_varlen.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, lse_layout="flash")
    out, lse = cudnn_varlen.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, lse_layout="padded")
    torch.testing.assert_close(out_flash_layout, out, atol=0, rtol=0)
    assert lse.shape == (cudnn_varlen.padded_segments(cu_q), heads, cudnn_varlen.padded_length(max_q), 1)
    ref_out, ref_lse = _varlen_reference_forward(q.float(), k.float(), v.float(), cu_q, cu_k, scale)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=0)
    starts, ends = cu_q[:-1].tolist(), cu_q[1:].tolist()
    for b, (s, e) in enumerate(zip(starts, ends)):  # the padded log-sum-exp of each segment's real queries
        torch.testing.assert_close(lse[b, :, : e - s, 0], ref_lse[:, s:e], atol=2e-2, rtol=0)
    grads = cudnn_varlen.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)
    ref = _varlen_reference_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), ref_lse, cu_q, cu_k, scale)
    _, flash_lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    assert lse_flash_layout.shape == flash_lse.shape and lse_flash_layout.is_contiguous()
    torch.testing.assert_close(lse_flash_layout, flash_lse, atol=2e-2, rtol=0)
    _assert_no_further_from_reference_than_flash(grads, ref, dout, q, k, v, out, flash_lse, cu_q, cu_k, max_q, max_k, scale)


@gpu
def test_cudnn_matches_flash_on_the_packed_segments():
    """train.packed_attention=cudnn and cudnn_full against flash through the model: the same log-probs and
    gradients up to bf16 rounding; and a second packed row of another shape reuses nothing of the first's metadata."""
    if not _cudnn_here():
        pytest.skip("needs nvidia-cudnn-frontend and cuDNN >= 9.6")
    for num_prompts in (3, 2):
        _assert_kernels_match_flash(dataclasses.replace(_batch(num_prompts=num_prompts), packed=True), ("cudnn", "cudnn_full"),
                                    label=f"{num_prompts} prompts")  # fmt: skip


@gpu
def test_tuned_lm_head_products_give_the_same_logprobs_and_gradients(monkeypatch):
    """train.tuned_products: the lm_head's chunk products through the cuBLASLt algorithms timed
    fastest (logits, and the weight gradient added by the product) agree with PyTorch's products
    up to bf16 rounding, full chunks and the short last one alike. Where the timing kept PyTorch's
    own pick, another candidate is installed, so that two algorithms are compared either way."""
    from hybridrl.kernels import cublaslt
    from hybridrl.train import lm_head

    torch.manual_seed(0)
    V, H, N, chunk = 32000, 896, 2 * 1024 + 300, 1024
    weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (N,), device="cuda")
    reports = lm_head.tune_lm_head(weight.detach(), chunk)
    assert set(reports) == {"logits", "weight_grad"} and all("choice" in r for r in reports.values()), reports
    layouts = [(chunk, V, H, dict(x_transposed=False, w_transposed=True, accumulate=False)),
               (V, H, chunk, dict(x_transposed=True, w_transposed=False, accumulate=True))]  # fmt: skip
    for m, n, k, layout in layouts:
        key = cublaslt._product_key(m, n, k, torch.bfloat16, torch.cuda.current_device(), variants=False, **layout)
        if cublaslt._CHOICES.get(key) is None:
            product = cublaslt.LtProduct(m, n, k, torch.bfloat16, bias=False, **layout)
            others = [c for c in product.candidates if not c.is_pytorch_pick]
            assert others, "cuBLASLt offered one algorithm only"
            product.use(others[-1])
            monkeypatch.setitem(cublaslt._CHOICES, key, product)
    calls = []
    run = cublaslt.LtProduct.__call__
    monkeypatch.setattr(cublaslt.LtProduct, "__call__", lambda self, *a, **kw: calls.append(self.shape) or run(self, *a, **kw))
    coef = torch.randn(N, device="cuda")
    token_grads = lambda rows, lp, ent: (coef[rows], 0.1 * coef[rows])  # noqa: E731
    results = {}
    for tuned in (False, True):
        lp, ent = lm_head.token_logprobs(hidden, weight, None, labels, chunk=chunk, tuned=tuned)
        grads = torch.autograd.grad((coef * lp + 0.1 * coef * ent).sum(), [hidden, weight])
        lp_f, ent_f, zero = lm_head.token_logprobs_with_grad(hidden, weight, None, labels, token_grads, chunk=chunk, tuned=tuned)
        grads_f = torch.autograd.grad(zero, [hidden, weight])
        results[tuned] = (lp, ent, *grads, lp_f, ent_f, *grads_f)
    # two full chunks per pass through each tuned product (the short last chunk goes to PyTorch)
    assert calls.count((chunk, V, H)) == 6 and calls.count((V, H, chunk)) == 4, calls
    for got, want in zip(results[True], results[False]):
        got, want = got.float(), want.float()
        assert (got - want).norm() <= 1e-2 * want.norm() + 1e-6
        assert (got - want).abs().max() <= 3e-2 * want.abs().max() + 1e-6


@gpu
def test_packed_keys_gradient_is_ordered_and_launches_no_sort_in_deterministic_mode():
    """The packed keys' gather (attention.gather_rows) on the GPU, compiled as the layer groups are,
    under torch's deterministic mode: its gradient equals index_select's summed in fp64, comes out
    the same bit for bit on every call, and launches no index_put_ (whose sorted form cost ~9,700
    kernel launches a W0.5B training step before it: train/NOTES.md, session 29)."""
    from hybridrl.train.attention import gather_rows
    from hybridrl.train.packing import pack_sequences

    torch.use_deterministic_algorithms(True)  # conftest restores the mode after the test
    layout = pack_sequences(_batch()).to(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(layout.length, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(layout.kv_index.numel(), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    fn = torch.compile(gather_rows, dynamic=True)
    first = torch.autograd.grad(fn(x, layout.kv_index, layout.kv_copies), x, grad)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        again = torch.autograd.grad(fn(x, layout.kv_index, layout.kv_copies), x, grad)[0]
        torch.cuda.synchronize()
    assert torch.equal(first, again)
    names = " ".join(e.name for e in prof.events())
    assert "index_put" not in names and "radix_sort" not in names and "index_add" not in names
    want = torch.zeros(x.shape, dtype=torch.float64, device="cuda").index_add_(0, layout.kv_index, grad.double())
    torch.testing.assert_close(first.double(), want, atol=1e-6, rtol=2**-8)  # one bf16 rounding of the fp32 sum


@gpu
@pytest.mark.parametrize("fused", [True, False])
def test_tied_lm_head_gradient_is_not_held_through_the_layers_backward(monkeypatch, fused):
    """The lm_head's part of a tied weight's gradient goes into `.grad` when it is made: the backward
    of the layers below no longer runs with a `[V, H]` gradient buffer waiting beside it for the
    embedding's part (the step's peak at W0.5B is in that backward). The layers here are wide MLPs,
    so that their backward, not the lm_head's chunks, sets the peak, as in a decoder's training
    step; the peak of a second micro-batch's backward (the first made `.grad`), with and without."""
    from hybridrl.train import lm_head

    V, H, I, N, depth, chunk = 65536, 512, 16384, 4096, 3, 256
    bytes_w = V * H * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    ups = [torch.nn.Parameter(torch.randn(H, I, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5) for _ in range(depth)]
    downs = [torch.nn.Parameter(torch.randn(I, H, device="cuda", dtype=torch.bfloat16, generator=g) / I**0.5) for _ in range(depth)]
    ids, labels = (torch.randint(0, V, (N,), device="cuda", generator=g) for _ in range(2))
    g_lp = torch.randn(N, device="cuda", generator=g)

    def loss_of_micro_batch():
        x = torch.nn.functional.embedding(ids, weight)
        for up, down in zip(ups, downs):  # [N, I] activations and gradients: each layer's backward is larger than the lm_head's chunk
            x = x + torch.tanh(x @ up) @ down
        if fused:
            _, _, loss = lm_head.token_logprobs_with_grad(x, weight, None, labels, lambda rows, lp, ent: (g_lp[rows], None), chunk=chunk)
            return loss
        lp, _ = token_logprobs(x, weight, None, labels, chunk=chunk)
        return (lp * g_lp).sum()

    def peak_and_grads():
        for p in (weight, *ups, *downs):
            p.grad = None
        loss_of_micro_batch().backward()
        loss = loss_of_micro_batch()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, weight.grad.float().clone()

    new_peak, new_grad = peak_and_grads()
    through_autograd = lambda self, grad_w, scale=None: grad_w if scale is None else grad_w.mul_(scale)  # noqa: E731
    monkeypatch.setattr(lm_head._WeightGrad, "deliver", through_autograd)  # the gradient through autograd, as before
    old_peak, old_grad = peak_and_grads()
    assert old_peak - new_peak >= 0.9 * bytes_w, (old_peak, new_peak, bytes_w)
    torch.testing.assert_close(new_grad, old_grad, atol=1e-3, rtol=2e-2)  # bf16 sums in another order
