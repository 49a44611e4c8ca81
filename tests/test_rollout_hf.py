import pytest
import torch

from hybridrl.rollout import RolloutEngine
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.logprobs import response_logprobs

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+55="]


def engine(path):
    return RolloutEngine.from_hf(str(path), backend="hf", device="cpu")


def test_greedy_is_deterministic_and_ordered(tiny_model_path):
    e = engine(tiny_model_path)
    a = e.generate(PROMPTS, n=3, max_tokens=6, temperature=0.0)
    b = e.generate(PROMPTS, n=3, max_tokens=6, temperature=0.0)
    assert [(s.prompt_index, s.sample_index) for s in a] == [(i, j) for i in range(4) for j in range(3)]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    # Greedy: the n samples of one prompt are identical.
    for i in range(4):
        assert len({tuple(s.response_ids) for s in a[3 * i : 3 * i + 3]}) == 1
    for s in a:
        assert s.finish_reason in ("stop", "length")
        assert len(s.response_logprobs) == len(s.response_ids) <= 6
        assert s.prompt == PROMPTS[s.prompt_index]
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == e.tokenizer.eos_token_id


def test_texts_decoded_later_equal_texts_decoded_at_once(tiny_model_path):
    e = engine(tiny_model_path)
    prompt_ids = e.encode_prompts(PROMPTS)
    now = e.generate(prompt_ids, n=2, max_tokens=6, temperature=1.0, seed=5)
    later = e.generate(prompt_ids, n=2, max_tokens=6, temperature=1.0, seed=5, detokenize=False)
    assert [s.response_ids for s in later] == [s.response_ids for s in now]
    assert all(s.response == "" and s.prompt == "" for s in later if s.response_ids)
    e.detokenize(later)
    assert [(s.prompt, s.response) for s in later] == [(s.prompt, s.response) for s in now]
    assert any(s.response for s in now) and all(s.prompt for s in now)


def test_seeded_sampling_reproducible(tiny_model_path):
    e = engine(tiny_model_path)
    a = e.generate(PROMPTS, n=4, max_tokens=6, temperature=1.0, seed=3)
    b = e.generate(PROMPTS, n=4, max_tokens=6, temperature=1.0, seed=3)
    c = e.generate(PROMPTS, n=4, max_tokens=6, temperature=1.0, seed=4)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_logprobs_match_full_forward(tiny_model_path):
    """Rollout log-probs equal the trainer's recomputation (softmax(logits / T)) on mixed-length prompts."""
    e = engine(tiny_model_path)
    for temperature in (1.0, 0.7):
        samples = e.generate(PROMPTS, n=2, max_tokens=6, temperature=temperature, seed=0)
        batch = build_sequence_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], e.tokenizer.pad_token_id)
        with torch.no_grad():
            lp, _ = response_logprobs(e.model, batch, temperature=temperature)
        for b, s in enumerate(samples):
            got = lp[b, : len(s.response_ids)]
            assert torch.allclose(got, torch.tensor(s.response_logprobs), atol=1e-4), (b, got, s.response_logprobs)


def test_per_prompt_max_tokens_and_chat_prompts(tiny_model_path):
    e = engine(tiny_model_path)
    out = e.generate(["1+1=", "2+2="], n=1, max_tokens=[1, 6], temperature=1.0, seed=0)
    assert len(out[0].response_ids) == 1
    chat = e.generate([[{"role": "user", "content": "1+1="}]], n=1, max_tokens=6, temperature=0.0)
    plain = e.generate(["1+1="], n=1, max_tokens=6, temperature=0.0)
    assert chat[0].response_ids == plain[0].response_ids  # the tiny chat template concatenates turns


def test_chunked_logprobs_and_entropy_match_full_logits(tiny_model_path):
    e = engine(tiny_model_path)
    samples = e.generate(PROMPTS, n=2, max_tokens=6, temperature=1.0, seed=1)
    batch = build_sequence_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], e.tokenizer.pad_token_id)
    with torch.no_grad():
        lp_chunked, ent_chunked = response_logprobs(e.model, batch, with_entropy=True, chunk_size=2)
        logits = e.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits.float()
    P, T = batch.prompt_width, batch.response_mask.shape[1]
    full = torch.log_softmax(logits[:, P - 1 : P - 1 + T], -1)
    lp_full = full.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * batch.response_mask
    ent_full = -(full.exp() * full).sum(-1) * batch.response_mask
    assert torch.allclose(lp_chunked, lp_full, atol=1e-5)
    assert torch.allclose(ent_chunked, ent_full, atol=1e-5)


def test_unknown_backend_is_a_clear_error(tiny_model_path):
    import pytest

    with pytest.raises(ValueError, match="rollout backend 'fast' is not known"):
        RolloutEngine.from_hf(str(tiny_model_path), backend="fast")


def test_engine_stats_sum_over_calls_and_pop_resets(tiny_model_path):
    from hybridrl import RolloutEngine

    e = RolloutEngine.from_hf(str(tiny_model_path), backend="hf", device="cpu")
    e.generate(["1+1="], n=2, max_tokens=3, seed=0)
    e.generate(["2+2="], n=2, max_tokens=3, seed=0)
    e.sleep()
    stats = e.pop_stats()
    assert {"generate_s", "postprocess_s", "sleep_s"} <= set(stats) and stats["generate_s"] > 0
    assert e.pop_stats() == {}


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_batch_gives_the_tokenizers_own_texts(tiny_model_path, clean_up):
    from hybridrl.rollout.engine import decode_batch

    tok = engine(tiny_model_path).tokenizer
    tok.clean_up_tokenization_spaces = clean_up  # True: the Python path (transformers' own clean-up)
    g = torch.Generator().manual_seed(0)
    specials = [i for i in (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) if i is not None]
    ids = [torch.randint(0, len(tok), (n,), generator=g).tolist() + specials for n in (0, 1, 7, 40)]
    for skip in (False, True):
        assert decode_batch(tok, ids, skip_special_tokens=skip) == tok.batch_decode(ids, skip_special_tokens=skip)
    assert decode_batch(tok, []) == []
