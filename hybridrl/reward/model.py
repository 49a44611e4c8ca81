"""Learned reward models: a sequence classifier with one output (`num_labels=1`) scoring
(prompt, response) pairs.

    reward = RewardEngine.from_hf("path/to/reward-model", offload=True)

A pair is rendered with the reward model's own tokenizer exactly as preference data is for
reward-model training (`algorithm: rm`, `hybridrl.data.preference`): a string prompt is text as
is, chat messages are rendered with the model's chat template (the response as the assistant
turn); a string response follows the prompt and ends with EOS. The score is the head's output at
the last token. Pairs are scored in micro-batches of at most `max_batch_tokens` padded tokens,
longest first, with the weights resident on the device or streamed from CPU memory
(`offload.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.data.chat import append_eos, encode_continuation, encode_prompt_text, render_chat
from hybridrl.models.loading import ModelLoadError, check_model_path, load_tokenizer, resolve_device, resolve_dtype
from hybridrl.reward.normalize import RunningMeanStd
from hybridrl.reward.offload import LayerRunner, MicroBatch
from hybridrl.reward.types import RewardError

SOURCE = "reward model input"


def load_sequence_classifier(
    path: str, *, dtype: torch.dtype, pad_token_id: int, trust_remote_code: bool = False
) -> tuple[torch.nn.Module, bool]:
    """`AutoModelForSequenceClassification(num_labels=1)` on the CPU, in eval mode, and whether its
    head is new (the checkpoint is a causal LM, not a reward model): a new head starts at zero, so
    every first score is 0."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    check_model_path(path)
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
        if config.pad_token_id is None:
            config.pad_token_id = pad_token_id  # lets plain transformers batch the saved model too
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a reward model (sequence classifier, num_labels=1) from {path}: {e}") from None
    new_head = any(key.startswith("score.") for key in info["missing_keys"])
    if new_head:
        torch.nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    return model.eval(), new_head


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Differentiable scores `[B]` (float32) of right-padded sequences: the head at each last token.
    The training-side twin of `LayerRunner.scores` (same numbers, up to float rounding)."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    last = attention_mask.sum(-1) - 1  # [B]
    return model.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])[:, 0].float()


def right_padded(sequences: list[list[int]], pad_id: int) -> MicroBatch:
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    input_ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return MicroBatch(input_ids, lengths)


def token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest first, each group's padded size (size x longest) within `max_tokens`
    (a sequence longer than that is a group of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class TrainableRewardModel:
    """A reward model to train with `algorithm: rm`: the `actor` TrainerEngine takes for it."""

    model: torch.nn.Module
    tokenizer: Any
    path: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_hf(cls, path: str, *, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False,
                chat_template: str | None = None) -> TrainableRewardModel:
        """Starts from a reward model, or from a causal LM (e.g. the SFT policy) with a fresh head."""
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, chat_template=chat_template)
        dev = resolve_device(device)
        model, _ = load_sequence_classifier(path, dtype=resolve_dtype(dtype, dev), pad_token_id=tokenizer.pad_token_id,
                                            trust_remote_code=trust_remote_code)
        return cls(model.to(dev), tokenizer, path)


class RewardModel:
    """A reward component backed by a sequence classifier (see the module docstring).

    `offload=True` keeps the weights in CPU memory between calls and streams them to `device`
    layer by layer while scoring; `offload=False` keeps them on `device`. `normalize` maps scores
    to `(score - mean) / std` with the running statistics of every score so far (this batch
    included; saved in checkpoints through `state_dict`); `clip` then bounds them to
    `[-clip, clip]`. `max_length` keeps only the last `max_length` tokens of a pair.
    """

    per_sample = False  # one call per batch, never per sample (see RewardComponent)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        name: str = "reward_model",
        offload: bool = True,
        device: str | torch.device = "auto",
        normalize: bool = False,
        clip: float | None = None,
        max_batch_tokens: int = 4096,
        max_wave_tokens: int = 32768,
        max_length: int | None = None,
    ):
        for key, value in (("max_batch_tokens", max_batch_tokens), ("max_wave_tokens", max_wave_tokens),
                           ("max_length", max_length or 1), ("clip", clip or 1.0)):
            if not value > 0:
                raise RewardError(f"reward model {name!r}: `{key}` must be positive, got {value!r}")
        self.name = name
        self.tokenizer = tokenizer
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.runner = LayerRunner(model, self.device, offload=offload, max_wave_tokens=max_wave_tokens)
        self.normalizer = RunningMeanStd() if normalize else None
        self.clip = clip
        self.max_batch_tokens = max_batch_tokens
        self.max_length = max_length
        self.path: str | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: str = "auto",
        device: str | torch.device = "auto",
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> RewardModel:
        """Loads a reward model from a Hub id or a local directory (`kwargs`: see the class)."""
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, chat_template=chat_template)
        dev = device if isinstance(device, torch.device) else resolve_device(device)
        model, new_head = load_sequence_classifier(path, dtype=resolve_dtype(dtype, dev),
                                                   pad_token_id=tokenizer.pad_token_id, trust_remote_code=trust_remote_code)
        if new_head:
            raise ModelLoadError(f"{path} has no reward head (score.weight): it is a language model, not a reward "
                                 "model, and would score everything 0; train one with algorithm: rm")
        reward_model = cls(model, tokenizer, device=dev, **kwargs)
        reward_model.path = path
        return reward_model

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def offload(self) -> bool:
        return self.runner.offload

    def __call__(self, prompts: list, responses: list[str], **columns: Any) -> list[float]:
        scores = self.raw_scores(self.encode(prompts, responses))
        if self.normalizer is not None:
            self.normalizer.update(scores)
            scores = self.normalizer.normalize(scores)
        if self.clip is not None:
            scores = [min(self.clip, max(-self.clip, s)) for s in scores]
        return scores

    def encode(self, prompts: list, responses: list[str]) -> list[list[int]]:
        """Token ids of each (prompt, response) pair, rendered as the module docstring says."""
        return [self._encode_pair(prompt, response, index)
                for index, (prompt, response) in enumerate(zip(prompts, responses, strict=True))]

    def _encode_pair(self, prompt: str | list[dict], response: str, index: int) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            ids = encode_prompt_text(tok, prompt) + append_eos(tok, encode_continuation(tok, response))
        else:
            where = dict(source=SOURCE, row=index, field="prompt")
            prompt_text = render_chat(tok, prompt, add_generation_prompt=True, **where)
            full = render_chat(tok, [*prompt, {"role": "assistant", "content": response}], add_generation_prompt=False,
                               **where)
            if not full.startswith(prompt_text):
                raise RewardError(f"reward model {self.name!r}: its chat template renders prompt + response differently "
                                  f"from the prompt alone (sample {index}); pass chat_template= to from_hf")
            ids = encode_prompt_text(tok, prompt_text) + encode_continuation(tok, full[len(prompt_text):])
        return ids[-self.max_length:] if self.max_length else ids

    def raw_scores(self, sequences: list[list[int]]) -> list[float]:
        """The head's output for each token sequence, before normalisation and clipping."""
        if not sequences:
            return []
        groups = token_budget_groups([len(s) for s in sequences], self.max_batch_tokens)
        pad_id = self.tokenizer.pad_token_id
        outputs = self.runner.scores([right_padded([sequences[i] for i in group], pad_id) for group in groups])
        scores = [0.0] * len(sequences)
        for group, output in zip(groups, outputs, strict=True):
            for i, value in zip(group, output.tolist(), strict=True):
                scores[i] = value
        return scores

    def state_dict(self) -> dict[str, Any]:
        return {"normalizer": self.normalizer.state_dict() if self.normalizer is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])

    def __repr__(self) -> str:
        return f"RewardModel({self.name!r}, {self.path or type(self.model).__name__}, offload={self.offload}, device={self.device})"
