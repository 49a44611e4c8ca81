"""The padded batch layout (`build_sequence_batch`) against a straightforward row-by-row reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridrl.train.batch import SequenceBatch, build_sequence_batch


def _reference_build_sequence_batch(prompt_ids, response_ids, pad_id):
    """The row-by-row version batch.py had before it read the token lists in one pass."""
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    input_ids = np.full((B, P + T), pad_id, dtype=np.int64)
    attention_mask = np.zeros((B, P + T), dtype=np.int64)
    response_mask = np.zeros((B, T), dtype=np.float32)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p) : P] = p
        attention_mask[b, P - len(p) : P] = 1
        if len(r):
            input_ids[b, P : P + len(r)] = r
            attention_mask[b, P : P + len(r)] = 1
            response_mask[b, : len(r)] = 1
    attention_mask = torch.from_numpy(attention_mask)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return SequenceBatch(torch.from_numpy(input_ids), attention_mask, position_ids, torch.from_numpy(response_mask), P)


def _random_rows(seed: int):
    """Prompt groups as the rollout gives them (the samples of a prompt share one list object),
    plus equal prompts in distinct lists, tuples, empty prompts and responses, pad-id tokens."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(rng.randint(1, 6)):
        prompt = [rng.randint(0, 9) for _ in range(rng.randint(0 if rng.random() < 0.1 else 1, 9))]
        for _ in range(rng.randint(1, 4)):
            shared = rng.random() < 0.7
            prompts.append(prompt if shared else tuple(prompt) if rng.random() < 0.5 else list(prompt))
            longest = rng.choice([0, 1, 6, 20])
            responses.append([rng.randint(0, 151935) for _ in range(rng.randint(0, longest))])
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[i] for i in order], [responses[i] for i in order], rng.choice([0, 3, 151643])


@pytest.mark.parametrize("seed", range(200))
def test_build_sequence_batch_matches_the_row_by_row_reference(seed):
    prompts, responses, pad_id = _random_rows(seed)
    got = build_sequence_batch(prompts, responses, pad_id)
    want = _reference_build_sequence_batch(prompts, responses, pad_id)
    assert got.prompt_width == want.prompt_width and got.packed == want.packed and got.tensors == want.tensors
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.device == b.device and a.is_contiguous() and torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(50))
def test_numpy_response_rows_lay_out_as_lists_do(seed):
    """The native engine hands responses and log-probs over as numpy rows (`GeneratedSequence.arrays`):
    joined without reading each number, they give the batch and padded log-probs the lists give."""
    from hybridrl.train.batch import pad_per_token

    prompts, responses, pad_id = _random_rows(seed)
    rows = [np.asarray(r, dtype=np.int64) for r in responses]
    got = build_sequence_batch(prompts, rows, pad_id)
    want = build_sequence_batch(prompts, responses, pad_id)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    rng = np.random.default_rng(seed)
    logprobs = [(-rng.random(len(r)) * 5).astype(np.float32) for r in responses]
    width = got.response_mask.shape[1]
    assert torch.equal(pad_per_token(logprobs, width), pad_per_token([lp.tolist() for lp in logprobs], width))


def test_numpy_rows_whose_lengths_disagree_are_refused():
    from hybridrl.train.batch import _flat

    with pytest.raises(ValueError, match="5 values where the lengths say 4"):
        _flat([np.arange(2), np.arange(3)], np.int64, 4)


def test_build_sequence_batch_of_no_rows_fails_as_before():
    with pytest.raises(ValueError) as got:
        build_sequence_batch([], [], 0)
    with pytest.raises(ValueError) as want:
        _reference_build_sequence_batch([], [], 0)
    assert str(got.value) == str(want.value)


def test_one_response_per_prompt_row():
    with pytest.raises(ValueError, match="3 prompts but 2 responses"):
        build_sequence_batch([[1], [2], [3]], [[4], [5]], pad_id=0)
