"""The tiny demo model: a character-level tokenizer and a small Qwen2-architecture model.

Both are ordinary HuggingFace objects, saved and loaded with `save_pretrained` /
`from_pretrained`, so every code path the demo exercises is the one real models take.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, "<|im_start|>", "<|im_end|>"]
# Every printable ASCII character is one token; the task only uses digits, '+', '=' and a few more.
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))

# A chat template that renders a conversation as the plain concatenation of its turns, so that
# chat-format prompt datasets work with the tiny model exactly like plain-string ones.
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer mapping each character to one token id, with pad, EOS and a chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split into single characters ("[\\s\\S]" so that newlines are characters too).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        padding_side="left",
        model_max_length=512,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model sized for the character vocabulary."""
    import torch

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
