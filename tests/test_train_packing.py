"""Packed rows (each prompt once, responses after it) against the padded layout; token-budget micro-batches."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.models import load_critic
from hybridrl.train.attention import BLOCK, _block_mask, enable_packed_attention, gather_rows, varlen_attention, packed_attention_mask
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.logprobs import response_logprobs, response_values
from hybridrl.train import packing
from hybridrl.train.packing import PackedLayout, _bucket, _rows, _Rows, key_copies, micro_batch_work, pack_sequences, plan_micro_batches


def _batch(num_prompts=4, n=3, seed=0, max_response=7):
    """Prompts of different lengths, n responses each (some empty), as an RL step makes them."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(num_prompts):
        prompt = torch.randint(5, 100, (3 + 2 * i,), generator=g).tolist()
        for _ in range(n):
            length = int(torch.randint(0, max_response + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(5, 100, (length,), generator=g).tolist())
    return build_sequence_batch(prompts, responses, pad_id=0)


@pytest.mark.parametrize("kernel", ["auto", "flash", "triton", "triton_full", "fa4", "cudnn", "cudnn_full"])
def test_packed_and_padded_logprobs_entropy_and_gradients_agree(tiny_model_path, kernel):
    """auto on CPU: the dense packed mask; flash / fa4 / cudnn: the varlen segments through the kernels' reference."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert enable_packed_attention(model, kernel) == ("flex" if kernel == "auto" else kernel)
    batch = _batch()
    packed = dataclasses.replace(batch, packed=True)
    lp_pad, ent_pad = response_logprobs(model, batch, with_entropy=True)
    grads_pad = torch.autograd.grad((lp_pad.sum() + ent_pad.sum()), list(model.parameters()))
    lp_pack, ent_pack = response_logprobs(model, packed, with_entropy=True)
    grads_pack = torch.autograd.grad((lp_pack.sum() + ent_pack.sum()), list(model.parameters()))
    assert (lp_pad != 0).sum() == batch.num_response_tokens
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pack, ent_pad, atol=1e-5, rtol=0)
    for gp, gq in zip(grads_pad, grads_pack):
        torch.testing.assert_close(gq, gp, atol=1e-4, rtol=1e-4)


def test_packed_and_padded_critic_values_agree(tiny_model_path):
    critic = load_critic(str(tiny_model_path), device="cpu")
    torch.nn.init.normal_(critic.score.weight)  # a zero head would agree trivially
    enable_packed_attention(critic)
    batch = _batch(seed=1)
    with torch.no_grad():
        padded = response_values(critic, batch)
        packed = response_values(critic, dataclasses.replace(batch, packed=True))
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def test_packed_row_holds_each_prompt_once_and_isolates_responses():
    # One prompt [5, 6, 7] with responses [10, 11] and [12]; a second prompt [8] with response [13].
    batch = build_sequence_batch([[5, 6, 7], [5, 6, 7], [8]], [[10, 11], [12], [13]], pad_id=0)
    layout = pack_sequences(batch)
    assert layout.input_ids[0].tolist() == [5, 6, 7, 10, 11, 12, 8, 13]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1]
    assert layout.labels.tolist() == [10, 11, 12, 13]
    assert layout.logit_index.tolist() == [2, 3, 2, 6]  # the token before each response token
    T = batch.response_mask.shape[1]
    assert layout.target_index.tolist() == [0, 1, 1 * T, 2 * T]
    mask = packed_attention_mask(layout)[0, 0]
    # token 5 (response 2, "12") sees the prompt and itself, not response 1 ("10", "11")
    assert mask[5].tolist() == [True, True, True, False, False, True, False, False]
    assert mask[7].tolist() == [False] * 6 + [True, True]  # the second prompt's response sees only its prompt


def test_block_mask_classifies_every_tile_like_the_dense_mask():
    """The FlexAttention block mask built for CUDA: a tile it skips is all-masked in the dense mask,
    a tile it marks full is all-visible, and its mask_mod is the dense mask."""
    g = torch.Generator().manual_seed(0)
    long_prompt, short_prompt = torch.randint(5, 100, (300,), generator=g).tolist(), [7] * 40
    batch = build_sequence_batch([long_prompt, long_prompt, short_prompt], [list(range(5, 265)), [9] * 93, [8] * 21], pad_id=0)
    layout = pack_sequences(batch, pad_to_multiple=BLOCK)
    block_mask = _block_mask(layout, layout.length, torch.device("cpu"))
    dense = packed_attention_mask(layout)[0, 0]
    nb = layout.length // BLOCK
    tiles = dense.view(nb, BLOCK, nb, BLOCK).permute(0, 2, 1, 3).flatten(2)  # [q tile, kv tile, BLOCK^2]

    def listed(counts, indices):
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for q in range(nb):
            out[q, indices[0, 0, q, : counts[0, 0, q]].long()] = True
        return out

    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert full.any() and partial.any() and not (full & partial).any()
    assert tiles[full].all()
    assert not tiles[~(full | partial)].any()
    assert tiles[partial].any(-1).all() and not tiles[partial].all(-1).any()
    q, kv = torch.meshgrid(torch.arange(layout.length), torch.arange(layout.length), indexing="ij")
    assert torch.equal(block_mask.mask_mod(0, 0, q, kv), dense)


def _segment_attention(q, k, v, layout):
    """What the flash kernel computes from the layout's varlen segments: per segment, its queries
    over its gathered keys, causal from the bottom right (q `[L, H, D]`, k / v `[L, H, D]`)."""
    cu_q, cu_k = layout.cu_seq_q.tolist(), layout.cu_seq_k.tolist()
    keys, values = k[layout.kv_index], v[layout.kv_index]
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)  # bottom-right causal
        out[qs] = torch.nn.functional.scaled_dot_product_attention(
            q[qs].transpose(0, 1), keys[ks].transpose(0, 1), values[ks].transpose(0, 1), attn_mask=allowed
        ).transpose(0, 1)
    return out


def test_packed_rows_refuse_sequences_longer_than_a_sliding_window():
    """A sliding window the packed kernels do not apply is an error naming the fix, not wrong
    log-probs; within the window (or for a model without one) packing runs."""
    import transformers

    config = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=12)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    enable_packed_attention(model)
    short = dataclasses.replace(build_sequence_batch([[5, 6, 7]] * 2, [[8, 9], [10]], pad_id=0), packed=True)
    response_logprobs(model, short)
    long = dataclasses.replace(build_sequence_batch([[5] * 8] * 2, [[8] * 5, [9]], pad_id=0), packed=True)
    with pytest.raises(ValueError, match="train.packing=off"):
        response_logprobs(model, long)
    model.config.sliding_window = None
    response_logprobs(model, long)


@pytest.mark.parametrize("pad", [1, BLOCK])
def test_varlen_segments_compute_the_packed_mask_attention(pad):
    """The flash kernel's segments (cu_seq_q, cu_seq_k, kv_index) give each token exactly the keys
    the packed mask lets it see: same attention output, on CPU, for every token but the padding."""
    batch = _batch(num_prompts=4, n=3, seed=5, max_response=9)
    layout = pack_sequences(batch, pad_to_multiple=pad)
    L = layout.length
    assert layout.cu_seq_q[-1] == L and layout.cu_seq_k[-1] == layout.kv_index.numel()
    seg_q = (layout.cu_seq_q[1:] - layout.cu_seq_q[:-1]).tolist()
    seg_k = (layout.cu_seq_k[1:] - layout.cu_seq_k[:-1]).tolist()
    assert max(seg_q) <= layout.max_q < 2 * max(seg_q) and max(seg_k) <= layout.max_k < 2 * max(seg_k)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dense = packed_attention_mask(layout)[0, 0]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=dense).transpose(0, 1)
    got = _segment_attention(q, k, v, layout)
    real = layout.num_tokens
    torch.testing.assert_close(got[:real], want[:real])


@pytest.mark.parametrize("pad", [1, BLOCK])
def test_key_copies_list_every_copy_of_each_position_in_order(pad):
    """In torch's deterministic mode kv_copies row j holds exactly the places i with kv_index[i] == j,
    ascending, then K: a prompt token once for its prompt and once for each of its responses, every
    other position once. Outside that mode the layout has none (the keys' gradient keeps index_add_),
    nor without gradients (the reference pass: no keys' gradient to order)."""
    batch = _batch(num_prompts=4, n=3, seed=5, max_response=9)
    assert pack_sequences(batch, pad_to_multiple=pad).kv_copies is None
    torch.use_deterministic_algorithms(True)  # conftest restores the mode after the test
    with torch.no_grad():
        assert pack_sequences(batch, pad_to_multiple=pad).kv_copies is None
    layout = pack_sequences(batch, pad_to_multiple=pad)
    kv, copies, K = layout.kv_index.tolist(), layout.kv_copies, layout.kv_index.numel()
    assert copies.shape[0] == layout.length and copies.dtype == torch.int64
    for j in range(layout.length):
        want = [i for i, src in enumerate(kv) if src == j]
        row = copies[j].tolist()
        assert row == want + [K] * (copies.shape[1] - len(want)), j
    is_prompt = layout.branch_ids[: layout.num_tokens] == 0
    counts = (copies < K).sum(1)
    assert (counts[: layout.num_tokens][~is_prompt] == 1).all() and (counts[layout.num_tokens :] == 1).all()
    assert copies.shape[1] == int(counts.max()) == 1 + 3  # a prompt token: its prompt, then 3 responses
    empty = key_copies(np.zeros(0, dtype=np.int64), 0)
    assert empty.shape == (0, 1)


@pytest.mark.parametrize("compiled", [False, True])
def test_gather_rows_gradient_is_index_selects_summed_in_fixed_order(compiled):
    """gather_rows (the packed keys' gather) returns index_select's rows, and its gradient equals
    index_select's (index_add_'s) to fp32 rounding, eagerly and compiled; its backward calls neither
    index_add_ (atomics on a GPU) nor index_put_ (the sorted form torch's deterministic mode puts there)."""
    torch.use_deterministic_algorithms(True)  # conftest restores the mode after the test
    batch = _batch(num_prompts=3, n=4, seed=11, max_response=9)
    layout = pack_sequences(batch, pad_to_multiple=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(layout.length, 2, 8, generator=g, requires_grad=True)
    grad = torch.randn(layout.kv_index.numel(), 2, 8, generator=g)
    fn = torch.compile(gather_rows, backend="aot_eager", fullgraph=True) if compiled else gather_rows
    rows = fn(x, layout.kv_index, layout.kv_copies)
    assert torch.equal(rows, x.index_select(0, layout.kv_index))
    (got,) = torch.autograd.grad(rows, x, grad)
    (want,) = torch.autograd.grad(x.index_select(0, layout.kv_index), x, grad)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with torch.profiler.profile() as prof:
        torch.autograd.grad(gather_rows(x, layout.kv_index, layout.kv_copies), x, grad)
    names = {e.name for e in prof.events()}
    assert "aten::index_add" not in names and "aten::index_put_" not in names and "aten::_index_put_impl_" not in names


def test_flash_reference_is_segment_attention_with_its_gradients():
    """Off CUDA, `varlen_attention` (the flash kernel's contract: grouped-query heads, bottom-right
    causal segments) runs a dense reference; its output and its hand-written backward (from the saved
    log-sum-exp, as the kernel's) match autograd through per-segment attention."""
    batch = _batch(num_prompts=3, n=3, seed=7, max_response=9)
    layout = pack_sequences(batch, pad_to_multiple=4)
    L, K = layout.length, layout.kv_index.numel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(L, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    keys, values = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
    out, lse = varlen_attention(q, keys, values, layout.cu_seq_q, layout.cu_seq_k, layout.max_q, layout.max_k, 8**-0.5, "flash")
    assert lse.shape == (4, L) and lse.dtype == torch.float32
    want = _segment_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), layout)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert K == layout.cu_seq_k[-1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_layer_groups_match_the_eager_model_with_checkpointing(deterministic):
    """train.compile_layers_per_graph=2 on a 3-layer model (groups of 2 and 1): the layers, their
    gradient checkpointing and the varlen attention traced into one graph per group (no graph
    breaks), over packed micro-batches of changing shapes, give the eager HF forward's log-probs and
    gradients; parameters and state dict are the model's own. In torch's deterministic mode the
    keys' gradient goes through gather_rows' ordered sum, in both."""
    import transformers

    from hybridrl.train.setup import compile_layers, enable_activation_checkpointing

    torch.use_deterministic_algorithms(deterministic)  # conftest restores the mode after the test

    config = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    batches = [dataclasses.replace(_batch(num_prompts=p, n=n, seed=p), packed=True) for p, n in ((3, 2), (2, 3), (4, 2))]

    def run(compiled: bool):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).train()
        enable_activation_checkpointing(model)
        enable_packed_attention(model, "flash")
        names = list(model.state_dict())
        if compiled:
            compile_layers(model, 2)
            assert [len(g.layers) for g in model.model._hybridrl_layer_groups] == [2, 1]
            assert list(model.state_dict()) == names and len(list(model.parameters())) == len(names)
        outs = []
        for batch in batches:
            lp, ent = response_logprobs(model, batch, with_entropy=True)
            grads = torch.autograd.grad(lp.sum() + ent.sum(), list(model.parameters()))
            outs.append((lp, torch.cat([g.flatten() for g in grads])))
        return outs

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = run(False), run(True)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the groups did run compiled
    for (lp_e, g_e), (lp_c, g_c) in zip(eager, compiled):
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
        torch.testing.assert_close(g_c, g_e, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="compile_layers_per_graph"):
        compile_layers(transformers.Qwen2ForCausalLM(config), 0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8))  # fmt: skip
    with pytest.raises(ValueError, match="set it to 1"):
        compile_layers(gemma, 2)


def _tiny_qwen2(num_layers: int):
    """A seeded random Qwen2 small enough to compile on CPU in seconds, in training mode."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def test_plain_module_forwards_drops_the_hub_kernel_wrapper_only_where_no_kernel_is_installed():
    """transformers >= 5.25 (with `kernels`) wraps the attention's forward to route hub kernels; the
    wrapper's context variable breaks compile_layers' traced checkpointing. plain_module_forwards gives
    each module without an installed hub kernel its class's own forward (the same outputs) and leaves a
    module that kernelize gave a kernel (an instance forward on its wrapper) alone."""
    import types

    pytest.importorskip("kernels")
    from hybridrl.train.setup import plain_module_forwards

    model = _tiny_qwen2(num_layers=2).eval()
    attention = [layer.self_attn for layer in model.model.layers]
    if not hasattr(type(attention[0]).forward, "__wrapped__") or "_kernel_funcs" not in attention[0].__dict__:
        pytest.skip("this transformers does not wrap the attention's forward")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    installed = next(iter(attention[1]._kernel_funcs.values()))
    installed.forward = types.MethodType(type(installed).forward, installed)  # as kernelize installs a hub kernel
    assert plain_module_forwards(model.model.layers) == 1
    assert "forward" in attention[0].__dict__ and "forward" not in attention[1].__dict__
    assert attention[0].forward.__func__ is type(attention[0]).forward.__wrapped__
    assert plain_module_forwards(list(model.model.layers)) == 0  # done once; a list of layers works too
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_compiled_layer_groups_compile_once_per_grad_mode():
    """The reference pass runs a frozen copy of the policy without gradients: the layer groups compile
    one graph for it and one for training. (transformers' gradient checkpointing hooks the input
    embeddings so that their output requires grad, for reentrant checkpointing of frozen
    embeddings; under no_grad only the first group's input then required grad, and every group
    was compiled once more.)"""
    import copy

    from hybridrl.config import TrainConfig
    from hybridrl.train.setup import compile_layers, prepare_for_training

    model = _tiny_qwen2(num_layers=4)
    assert prepare_for_training(model, TrainConfig(packing="on", packed_attention="flash"), gradient_checkpointing=True)
    ref = copy.deepcopy(model).eval().requires_grad_(False)  # as the trainer's frozen reference
    with torch.no_grad():
        assert not ref.model.embed_tokens(torch.tensor([[1, 2]])).requires_grad
    compile_layers(model, 2)
    compile_layers(ref, 2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed in range(2):  # the same shapes (a new shape may recompile), other tokens
        batch = dataclasses.replace(_batch(num_prompts=3, n=2, seed=0), packed=True)
        batch.input_ids.random_(5, 100, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            response_logprobs(ref, batch)
        lp, _ = response_logprobs(model, batch)
        lp.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_dynamic_compiles_one_training_graph_for_every_micro_batch_size(dynamic, deterministic):
    """train.compile_dynamic: micro-batches of different tokens, segments and gathered keys (the
    longest segments' buckets equal) run through one training graph; without it, two. So too in
    torch's deterministic mode, where the keys' copies table (kv_copies) also changes width."""
    from hybridrl.config import TrainConfig
    from hybridrl.train.setup import compile_layers, prepare_for_training

    torch.use_deterministic_algorithms(deterministic)  # conftest restores the mode after the test
    model = _tiny_qwen2(num_layers=4)
    prepare_for_training(model, TrainConfig(packing="on", packed_attention="flash"), gradient_checkpointing=True)
    compile_layers(model, 2, dynamic_tokens=dynamic)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for p, n in ((3, 2), (2, 3), (4, 2)):
        g = torch.Generator().manual_seed(p)
        prompts = [torch.randint(5, 100, (3 + i,), generator=g).tolist() for i in range(p)]
        batch = build_sequence_batch([q for q in prompts for _ in range(n)],
                                     [torch.randint(5, 100, (6,), generator=g).tolist() for _ in range(p * n)], pad_id=0)  # fmt: skip
        batch = dataclasses.replace(batch, packed=True)
        layout = pack_sequences(batch)
        assert (layout.max_q, layout.max_k) == (8, 16)
        assert (layout.kv_copies is not None and layout.kv_copies.shape[1] == n + 1) if deterministic else layout.kv_copies is None
        lp, _ = response_logprobs(model, batch)
        lp.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == (1 if dynamic else 2)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("budget", [8, 20, 37, 1000])
def test_token_budget_micro_batches_cover_every_token_exactly_once(packed, budget):
    batch = dataclasses.replace(_batch(num_prompts=5, n=4, seed=3, max_response=9), packed=packed)
    plans = plan_micro_batches(batch, micro_batch_size=4, max_tokens=budget)
    rows = [b for plan in plans for b in plan]
    assert sorted(rows) == list(range(batch.size))  # every row once
    seen = torch.zeros_like(batch.response_mask)
    for plan in plans:
        micro = batch.select(plan)
        tokens = micro_batch_work(micro).tokens
        if packed:
            layout = pack_sequences(micro)
            assert layout.num_tokens == tokens
            T = micro.response_mask.shape[1]
            for flat in layout.target_index.tolist():
                seen[plan[flat // T], flat % T] += 1
        else:
            seen[plan] += torch.nn.functional.pad(micro.response_mask, (0, seen.shape[1] - micro.response_mask.shape[1]))
            tokens = micro.size * micro.input_ids.shape[1]  # padded: what the forward really runs
        single = len(plan) == 1
        assert tokens <= budget or single, (plan, tokens, budget)
    assert torch.equal(seen, batch.response_mask)  # every response token exactly once


def test_fixed_count_micro_batches_keep_prompt_groups_together():
    batch = dataclasses.replace(_batch(num_prompts=3, n=2), packed=True)
    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = batch.select(order)
    plans = plan_micro_batches(shuffled, micro_batch_size=2, max_tokens=None)
    assert all(len(p) == 2 for p in plans)
    for plan in plans:  # each micro-batch is the two responses of one prompt: one prompt copy
        micro = shuffled.select(plan)
        assert len(set(map(tuple, micro.input_ids[:, : micro.prompt_width].tolist()))) == 1


def test_work_counts_a_shared_prompt_once():
    batch = build_sequence_batch([[1, 2, 3, 4]] * 2, [[5, 6], [7]], pad_id=0)
    padded = micro_batch_work(batch)
    packed = micro_batch_work(dataclasses.replace(batch, packed=True))
    assert (padded.tokens, packed.tokens, packed.logit_tokens) == (6 + 5, 4 + 3, 3)
    # pairs: prompt 4*5/2 = 10; responses 2*4 + 3 = 11 and 1*4 + 1 = 5
    assert packed.attention_pairs == 26
    assert padded.attention_pairs == 6 * 7 // 2 + 5 * 6 // 2


# ---- the host-side layout against straightforward references -------------------------------------
# The references are the loop versions packing.py had before its layout was built with whole-array
# index arithmetic; every field must come out exactly equal.


def _reference_rows(batch):
    P = batch.prompt_width
    ids_h, mask_h, resp_h = batch.host_view()
    prompt_lens = mask_h[:, :P].sum(1).tolist()
    response_lens = resp_h.sum(1).long().tolist()
    ids = ids_h[:, :P].tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, (row, n) in enumerate(zip(ids, prompt_lens)):
        groups.setdefault(tuple(row[P - n :]), []).append(b)
    return _Rows(prompt_lens, response_lens, list(groups.values()))


def _reference_pack_sequences(batch, *, pad_to_multiple=1):
    rows = _reference_rows(batch)
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    ids_cpu = batch.host_view()[0]
    pieces, positions, docs, branches, logit_index, labels, target = [], [], [], [], [], [], []
    seg_q, seg_k, kv_pieces = [0], [0], []
    cursor = 0
    for g, group in enumerate(rows.groups):
        n_prompt = rows.prompt_lens[group[0]]
        pieces.append(ids_cpu[group[0], P - n_prompt : P])
        positions.append(torch.arange(n_prompt))
        docs.append(torch.full((n_prompt,), g))
        branches.append(torch.zeros(n_prompt, dtype=torch.long))
        prompt_keys = torch.arange(cursor, cursor + n_prompt)
        kv_pieces.append(prompt_keys)
        seg_q.append(seg_q[-1] + n_prompt)
        seg_k.append(seg_k[-1] + n_prompt)
        prompt_last = cursor + n_prompt - 1
        cursor += n_prompt
        for k, b in enumerate(group, start=1):
            n = rows.response_lens[b]
            if n == 0:
                continue
            tokens = ids_cpu[b, P : P + n]
            pieces.append(tokens)
            positions.append(torch.arange(n_prompt, n_prompt + n))
            docs.append(torch.full((n,), g))
            branches.append(torch.full((n,), k))
            logit_index.append(torch.cat([torch.tensor([prompt_last]), torch.arange(cursor, cursor + n - 1)]))
            labels.append(tokens)
            target.append(torch.arange(b * T, b * T + n))
            kv_pieces += [prompt_keys, torch.arange(cursor, cursor + n)]
            seg_q.append(seg_q[-1] + n)
            seg_k.append(seg_k[-1] + n_prompt + n)
            cursor += n
    num_tokens = cursor
    pad = -num_tokens % pad_to_multiple
    if pad:
        pieces.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.zeros(pad, dtype=torch.long))
        docs.append(torch.full((pad,), -1))
        branches.append(torch.zeros(pad, dtype=torch.long))
        kv_pieces.append(torch.arange(cursor, cursor + pad))
        seg_q.append(seg_q[-1] + pad)
        seg_k.append(seg_k[-1] + pad)
    empty = torch.zeros(0, dtype=torch.long)
    cu_q, cu_k = torch.tensor(seg_q, dtype=torch.int32), torch.tensor(seg_k, dtype=torch.int32)
    kv_index = torch.cat(kv_pieces) if kv_pieces else empty
    return PackedLayout(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None],
        doc_ids=torch.cat(docs),
        branch_ids=torch.cat(branches),
        logit_index=torch.cat(logit_index) if logit_index else empty,
        labels=torch.cat(labels) if labels else empty,
        target_index=torch.cat(target) if target else empty,
        num_tokens=num_tokens,
        cu_seq_q=cu_q,
        cu_seq_k=cu_k,
        kv_index=kv_index,
        kv_copies=torch.from_numpy(key_copies(kv_index.numpy(), num_tokens + pad)) if packing._ordered_key_gradient() else None,
        max_q=_bucket(int((cu_q[1:] - cu_q[:-1]).max()) if len(seg_q) > 1 else 1),
        max_k=_bucket(int((cu_k[1:] - cu_k[:-1]).max()) if len(seg_k) > 1 else 1),
    )


def _random_batch(seed: int):
    """A shuffled batch of prompt groups with every awkward case: prompts of different lengths (some
    holding the pad id, two prompts equal but for a leading pad-id token), empty responses, a group
    whose responses are all empty, one response far longer than the rest."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 9) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
        prompts.append([0] + prompts[0])  # same tokens after the pad id: a different prompt
    rows = []
    for prompt in prompts:
        longest = rng.choice([0, 1, 5, 12])
        for _ in range(rng.randint(1, 4)):
            rows.append((prompt, [rng.randint(0, 9) for _ in range(rng.randint(0, longest))]))
    if rng.random() < 0.3:
        rows[rng.randrange(len(rows))] = (prompts[0], [rng.randint(0, 9) for _ in range(40)])
    rng.shuffle(rows)
    batch = build_sequence_batch([p for p, _ in rows], [r for _, r in rows], pad_id=rng.choice([0, 3]))
    return dataclasses.replace(batch, packed=rng.random() < 0.5)


def _assert_layouts_equal(got, want):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


@pytest.mark.parametrize("seed", range(150))
def test_host_layout_matches_the_loop_reference(seed, monkeypatch):
    """_rows, plan_micro_batches, micro_batch_work and pack_sequences (pad_to_multiple 1, 4, BLOCK)
    over a whole batch and over its trimmed micro-batches (groups split across them, a response
    over the budget alone) equal the loop references field by field. plan_micro_batches and
    micro_batch_work read the batch only through _rows: their references are themselves on the
    loop version of _rows."""
    batch = _random_batch(seed)
    budget = random.Random(seed).choice([None, 1, 6, 15, 40, 1000])
    plans = plan_micro_batches(batch, micro_batch_size=3, max_tokens=budget)
    micros = [batch] + [batch.select(plan) for plan in plans]
    works = [micro_batch_work(micro) for micro in micros]
    with monkeypatch.context() as m:
        m.setattr(packing, "_rows", _reference_rows)
        assert plans == plan_micro_batches(batch, micro_batch_size=3, max_tokens=budget)
        assert works == [micro_batch_work(micro) for micro in micros]
    for micro in micros:
        assert _rows(micro) == _reference_rows(micro)
        for pad in (1, 4, BLOCK):
            _assert_layouts_equal(pack_sequences(micro, pad_to_multiple=pad), _reference_pack_sequences(micro, pad_to_multiple=pad))
