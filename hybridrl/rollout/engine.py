"""`RolloutEngine`: one generate() for every backend, text in and text + ids + log-probs out."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedTokenizerFast

from hybridrl.rollout.types import GeneratedSequence, GenerationRequest, RolloutSample

log = logging.getLogger("hybridrl.rollout")

# name -> factory(model, tokenizer, **kwargs) -> backend. Backends register themselves on import.
BACKENDS: dict[str, Callable[..., Any]] = {}


def register_backend(name: str, factory: Callable[..., Any]) -> None:
    BACKENDS[name] = factory


def decode_batch(tokenizer, ids: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
    """`tokenizer.batch_decode(ids, skip_special_tokens=...)`, through the Rust tokenizer's own
    `decode_batch` when that gives the same texts (a fast tokenizer whose `_decode` is the stock one
    and that cleans up no spaces). That one releases the GIL; transformers' `batch_decode` decodes
    row by row in Python and holds it (~50 ms for 256 x 512 tokens, measured), which would stall
    any other thread for as long."""
    if not ids:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return backend.decode_batch([list(x) for x in ids], skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)


def _hf_factory(model, tokenizer, **kwargs):
    from hybridrl.rollout.hf_backend import HFBackend

    return HFBackend(model, tokenizer, **kwargs)


register_backend("hf", _hf_factory)


def _native_supported(model) -> bool:
    try:
        from hybridrl.rollout.native import NativeBackend
    except ImportError:
        return False
    return NativeBackend.supports(model)


def _native_factory(model, tokenizer, **kwargs):
    from hybridrl.rollout.native import NativeBackend

    return NativeBackend(model, tokenizer, **kwargs)


register_backend("native", _native_factory)


class RolloutEngine:
    """Generates responses from a model whose weights it shares with the trainer.

        engine = RolloutEngine.from_hf("Qwen/Qwen2.5-0.5B-Instruct", backend="native")
        samples = engine.generate(["What is 2+2?"], n=4, max_tokens=64, temperature=1.0, seed=0)

    No weights are copied: generation reads the model's parameters in place, so an optimizer step
    is seen by the next `generate`. The native backend on GPU moves each layer's q/k/v and gate/up
    parameters into one tensor per group when it is built (rollout/native/fused.py), so build an
    optimizer over `engine.model` after the engine (TrainerEngine does).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        backend: str = "auto",
        *,
        native_options: dict[str, Any] | None = None,
        **backend_kwargs,
    ):
        """`backend_kwargs` go to the chosen backend; `native_options` (kv_cache_fraction,
        fp32_residual, ...) only to the native one, so one call serves `backend="auto"` on any device."""
        self.model = model
        self.tokenizer = tokenizer
        self.backend_name = self._choose_backend(model, backend)
        if self.backend_name == "native" and native_options:
            backend_kwargs = {**native_options, **backend_kwargs}
        self.backend = BACKENDS[self.backend_name](model, tokenizer, **backend_kwargs)
        self.stats: dict[str, float] = {}  # pop_stats()

    @classmethod
    def from_hf(
        cls,
        path: str,
        *,
        backend: str = "auto",
        dtype: str = "auto",
        device: str = "auto",
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
        native_options: dict[str, Any] | None = None,
        **backend_kwargs,
    ) -> "RolloutEngine":
        """Loads a model and tokenizer from a Hub id or a local directory."""
        from hybridrl.models import load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, chat_template=chat_template)
        model = load_causal_lm(
            path, dtype=dtype, device=device, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
        engine = cls(model, tokenizer, backend=backend, native_options=native_options, **backend_kwargs)
        engine.path = path
        return engine

    @staticmethod
    def _choose_backend(model, backend: str) -> str:
        on_gpu = next(model.parameters()).device.type == "cuda"
        if backend == "auto":
            return "native" if on_gpu and _native_supported(model) else "hf"
        if backend not in BACKENDS:
            raise ValueError(f"rollout backend {backend!r} is not known; choose one of {', '.join(sorted(BACKENDS))} or auto")
        if backend == "native" and not _native_supported(model):
            log.warning(
                "the native rollout engine does not support %s; falling back to the hf backend (transformers generate)",
                type(model).__name__,
            )
            return "hf"
        return backend

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode_prompts(self, prompts: Sequence[str | list[dict] | list[int]]) -> list[list[int]]:
        """Token ids for prompts given as text, chat messages, or ids already."""
        ids = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            elif p and isinstance(p[0], dict):
                text = self.tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                ids.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                ids.append(list(p))
            if not ids[-1]:
                raise ValueError(f"prompt {len(ids) - 1} is empty; every prompt needs at least one token")
        return ids

    def generate(
        self,
        prompts: Sequence[str | list[dict] | list[int]],
        *,
        n: int = 1,
        max_tokens: int | Sequence[int] = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        on_finished: Callable[[RolloutSample], None] | None = None,
        detokenize: bool = True,
    ) -> list[RolloutSample]:
        """n samples per prompt, ordered prompt by prompt. Greedy when temperature == 0.

        `detokenize=False` leaves the texts (`prompt` where prompts were given as ids, `response`)
        empty for a later `detokenize(samples)`, e.g. in a thread while the GPU runs the next pass
        (samples passed to `on_finished` always carry their text)."""
        prompt_ids = self.encode_prompts(prompts)
        limits = [max_tokens] * len(prompt_ids) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(prompt_ids):
            raise ValueError(f"max_tokens has {len(limits)} entries for {len(prompt_ids)} prompts; give one per prompt or one int")
        stops = list(stop_token_ids) if stop_token_ids is not None else [self.tokenizer.eos_token_id]
        request = GenerationRequest(
            prompt_ids=prompt_ids, n=n, max_tokens=limits, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop_token_ids=stops,
        )
        texts = [p if isinstance(p, str) else "" for p in prompts]

        def prompt_text(i: int) -> str:
            if not texts[i]:
                texts[i] = self.tokenizer.decode(prompt_ids[i])
            return texts[i]

        def to_sample(seq: GeneratedSequence, response: str | None = None) -> RolloutSample:
            return RolloutSample(
                prompt_index=seq.prompt_index,
                sample_index=seq.sample_index,
                prompt=prompt_text(seq.prompt_index) if response is None else texts[seq.prompt_index],
                prompt_ids=prompt_ids[seq.prompt_index],
                response=self.tokenizer.decode(seq.response_ids, skip_special_tokens=True) if response is None else response,
                response_ids=seq.response_ids,
                response_logprobs=seq.response_logprobs,
                finish_reason=seq.finish_reason,
                arrays=seq.arrays,
            )

        callback = None if on_finished is None else (lambda seq: on_finished(to_sample(seq)))
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            seqs = self.backend.generate(request, callback)
        finally:
            self.model.train(was_training)
        middle = time.perf_counter()
        samples = [to_sample(s, "") for s in seqs]
        if detokenize:
            self.detokenize(samples)
        self._add_stats({**self.backend.stats, "generate_s": middle - start,
                         "postprocess_s": time.perf_counter() - middle})  # fmt: skip
        return samples

    def detokenize(self, samples: Sequence[RolloutSample]) -> None:
        """Fills in the empty texts of samples (generate(detokenize=False)): one batched decode of
        the responses and one of the id-given prompts, outside the GIL where the tokenizer allows
        (`decode_batch`), so a thread running this does not stall the thread driving the GPU."""
        todo = [s for s in samples if not s.response and s.response_ids]
        for s, text in zip(todo, decode_batch(self.tokenizer, [s.response_ids for s in todo], skip_special_tokens=True)):
            s.response = text
        unique = {id(s.prompt_ids): s.prompt_ids for s in samples if not s.prompt}
        prompts = dict(zip(unique, decode_batch(self.tokenizer, list(unique.values()))))
        for s in samples:
            if not s.prompt:
                s.prompt = prompts[id(s.prompt_ids)]

    def sleep(self) -> None:
        """Frees generation memory (KV cache) so training can use it."""
        start = time.perf_counter()
        self.backend.sleep()
        self._add_stats({"sleep_s": time.perf_counter() - start})

    def _add_stats(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def pop_stats(self) -> dict[str, float]:
        """Where generation time went since the last call, summed over generate() / sleep() calls:
        `generate_s` (the backend), `postprocess_s` (detokenising into samples), `sleep_s`, and the
        native backend's own split (`prepare_s`, `prefill_s`, `decode_s`, `capture_s`, `host_syncs`,
        `graphs_reused`)."""
        stats, self.stats = self.stats, {}
        return stats

    def wake(self) -> None:
        self.backend.wake()
