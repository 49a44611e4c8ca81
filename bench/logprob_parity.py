"""Where the rollout / trainer log-prob difference comes from (BENCHMARK.md's W0.5B, random init).

    python bench/logprob_parity.py                 # W0.5B on the GPU
    python bench/logprob_parity.py --tiny          # a tiny model on CPU, in seconds

The native engine generates the responses (each engine variant its own set), then every response
token's log-prob is recomputed by several scorers:

- `fp32`: the model upcast to fp32, plain HF forward (the closest thing to the exact value);
- `hf`: the bf16 model, plain HF forward over the padded batch (sdpa);
- `trainer`: the trainer's path (`response_logprobs` on packed rows: FlexAttention on CUDA);
- `trainer+compile`: the same with `train.compile`'s compiled decoder layers (the benchmark setting);
- `... fp32-residual`: the trainer with `train.fp32_residual` (its residual stream in fp32).

Each response set comes from the engine with `rollout.fp32_residual` off, then on.

It prints mean |difference| for every pair: rollout vs each scorer (`rollout/logprob_diff/mean` is
rollout vs `trainer`), and each bf16 scorer vs `fp32`. A rollout that is closer to `fp32` than the
trainer is cannot be brought closer to the trainer by matching rounding; the table says which it is.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from hybridrl.models.synthetic import random_model
from hybridrl.rollout.native import NativeBackend
from hybridrl.rollout.types import GenerationRequest
from hybridrl.train.attention import enable_packed_attention
from hybridrl.train.batch import build_sequence_batch
from hybridrl.train.logprobs import response_logprobs
from hybridrl.train.residual import enable_fp32_residual
from hybridrl.train.setup import compile_layers


@torch.no_grad()
def plain_forward(model, prompts, outs, batch: int) -> list[torch.Tensor]:
    """log_softmax of a full forward's logits at each response token, per response (fp32, CPU)."""
    result = []
    for i in range(0, len(outs), batch):
        chunk = outs[i : i + batch]
        ids = torch.tensor([prompts[o.prompt_index] + o.response_ids for o in chunk], device=model.device)
        P = len(prompts[chunk[0].prompt_index])
        logits = model(ids).logits[:, P - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None])[..., 0]
        result.extend(lp.cpu())
    return result


@torch.no_grad()
def trainer_forward(model, prompts, outs, group: int) -> list[torch.Tensor]:
    """The trainer's log-probs: packed rows of `group` responses (one prompt, shared, per sample set)."""
    result = []
    for i in range(0, len(outs), group):
        chunk = outs[i : i + group]
        batch = build_sequence_batch([prompts[o.prompt_index] for o in chunk], [o.response_ids for o in chunk], pad_id=0)
        batch.packed = True
        lp, _ = response_logprobs(model, batch.to(model.device))
        result.extend(row[: len(o.response_ids)].float().cpu() for row, o in zip(lp, chunk))
    return result


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return d.mean().item(), d.max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["0.5B", "1.5B"], default="0.5B")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-trainer scorer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    size = "tiny" if args.tiny else args.size
    if args.tiny:
        args.prompts, args.prompt_len, args.n, args.max_tokens, args.no_compile = 4, 16, 2, 16, True

    model = random_model(size, device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    request = GenerationRequest(prompts, n=args.n, max_tokens=[args.max_tokens] * args.prompts,
                                temperature=1.0, seed=0, stop_token_ids=[])  # fmt: skip
    backend = NativeBackend(model, max_num_seqs=args.prompts * args.n)
    rollouts = {}
    for name, fp32_residual in (("rollout", False), ("rollout fp32-residual", True)):
        backend.sleep()  # drops graphs captured with the other residual dtype
        backend.decoder.fp32_residual = fp32_residual
        outs = backend.generate(request)
        rollouts[name] = (outs, [torch.tensor(o.response_logprobs) for o in outs])
    backend.sleep()

    scorers = {}
    exact = copy.deepcopy(model).float()
    scorers["fp32"] = lambda outs: plain_forward(exact, prompts, outs, batch=4)
    scorers["hf"] = lambda outs: plain_forward(model, prompts, outs, batch=16)
    trained = copy.deepcopy(model)
    enable_packed_attention(trained)
    scorers["trainer"] = lambda outs: trainer_forward(trained, prompts, outs, group=args.n)
    wide = copy.deepcopy(model)
    enable_fp32_residual(wide)
    enable_packed_attention(wide)
    scorers["trainer fp32-residual"] = lambda outs: trainer_forward(wide, prompts, outs, group=args.n)
    if not args.no_compile:
        compiled = copy.deepcopy(model)
        enable_packed_attention(compiled)
        compile_layers(compiled)
        scorers["trainer+compile"] = lambda outs: trainer_forward(compiled, prompts, outs, group=args.n)
        wide_compiled = copy.deepcopy(wide)
        compile_layers(wide_compiled)
        scorers["trainer+compile fp32-residual"] = lambda outs: trainer_forward(wide_compiled, prompts, outs, group=args.n)

    table = {}
    for rname, (outs, rollout_lp) in rollouts.items():
        scored = {sname: fn(outs) for sname, fn in scorers.items()}
        scored = {rname: rollout_lp, **scored}
        names = list(scored)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                table[f"{rname} set: {a} vs {b}"] = mean_abs(scored[a], scored[b])
    width = max(len(k) for k in table)
    print(f"[{size}] {args.prompts} prompts x {args.n} samples, {args.max_tokens} tokens; mean / max |log-prob difference|")
    for key, (mean, mx) in table.items():
        print(f"  {key:<{width}}  {mean:.4e}  {mx:.4e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"mean": m, "max": x} for k, (m, x) in table.items()}, f, indent=1)


if __name__ == "__main__":
    main()
