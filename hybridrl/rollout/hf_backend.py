"""The `hf` backend: transformers `generate`. Slow but exact; the reference the native engine is checked against."""

from __future__ import annotations

import torch

from hybridrl.rollout.types import GeneratedSequence, GenerationRequest, OnFinished


class HFBackend:
    """Generates with `model.generate` on the model's own parameters (no copy)."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_batch_size: int = 256, **unknown):
        if unknown:
            raise TypeError(
                f"the hf rollout backend takes no {', '.join(sorted(unknown))}: options of the native engine go in "
                "RolloutEngine(..., native_options={...}), which reaches the native backend only"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size  # sequences per generate call (memory bound)
        self.stats: dict[str, float] = {}  # generate() is one transformers call: no split of its time

    def sleep(self) -> None:  # transformers' cache lives only inside generate()
        pass

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, request: GenerationRequest, on_finished: OnFinished | None = None) -> list[GeneratedSequence]:
        jobs = [(i, j) for i in range(len(request.prompt_ids)) for j in range(request.n)]
        # Group by max_tokens so each generate call has one limit; order within is preserved.
        by_limit: dict[int, list[tuple[int, int]]] = {}
        for i, j in jobs:
            by_limit.setdefault(request.max_tokens[i], []).append((i, j))
        out: list[GeneratedSequence] = []
        with torch.random.fork_rng(devices=self._rng_devices()):
            if request.seed is not None:
                torch.manual_seed(request.seed)
            for limit, group in sorted(by_limit.items()):
                for start in range(0, len(group), self.max_batch_size):
                    chunk = group[start : start + self.max_batch_size]
                    for seq in self._generate_chunk(request, chunk, limit):
                        out.append(seq)
                        if on_finished is not None:
                            on_finished(seq)
        return sorted(out, key=lambda s: (s.prompt_index, s.sample_index))

    def _rng_devices(self) -> list[int]:
        dev = next(self.model.parameters()).device
        return [dev.index or 0] if dev.type == "cuda" else []

    def _generate_chunk(self, request: GenerationRequest, chunk: list[tuple[int, int]], limit: int) -> list[GeneratedSequence]:
        device = next(self.model.parameters()).device
        prompts = [request.prompt_ids[i] for i, _ in chunk]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):  # left padding: generation continues from the right edge
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        greedy = request.temperature == 0
        # top_k=0 disables top-k explicitly (None would mean the model's default, often 50).
        gen_kwargs = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k
        )
        stop = list(request.stop_token_ids) or [self.tokenizer.eos_token_id]
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=limit,
            eos_token_id=stop,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
            **gen_kwargs,
        )
        new_tokens = output.sequences[:, width:]  # [B, L]
        # Log-probs of the sampled tokens under softmax(logits / T), from the raw (unprocessed) logits.
        logits = torch.stack(output.logits, dim=1).float()  # [B, L, V]
        if not greedy:
            logits = logits / request.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        stop_set = set(stop)
        results = []
        for row, (i, j) in enumerate(chunk):
            ids = new_tokens[row].tolist()
            length, reason = len(ids), "length"
            for t, tok in enumerate(ids):
                if tok in stop_set:
                    length, reason = t + 1, "stop"
                    break
            results.append(
                GeneratedSequence(
                    prompt_index=i,
                    sample_index=j,
                    response_ids=ids[:length],
                    response_logprobs=logprobs[row, :length].tolist(),
                    finish_reason=reason,
                )
            )
        return results
