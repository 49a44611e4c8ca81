"""Typed run configuration: one dataclass per section, one comment per field.

Cross-field checks live in `validate.py` and run once, when a config is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    path: str = ""  # HF Hub id or local directory of the policy (actor) model
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "float32", "bfloat16" or "float16"
    attn_implementation: str | None = None  # e.g. "sdpa", "eager"; None lets transformers choose
    trust_remote_code: bool = False  # run code shipped with the model; off unless you trust it
    chat_template: str | None = None  # Jinja chat template to use when the tokenizer has none
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    # with gradient_checkpointing: checkpoint only the first N decoder layers (None: all of them); the last ones
    # keep their activations and are not recomputed in the backward. Memory for time: at W0.5B on an H200, 20 of
    # 24 took 0.035 s off a 1.197 s training phase for 1.9 GiB more peak (16 of 24: 0.050 s for 3.8 GiB)
    gradient_checkpointing_layers: int | None = None
    critic_path: str | None = None  # critic (value model) init; None means start from model.path
    reward_model_path: str | None = None  # learned reward model (sequence classifier), optional


@dataclass
class DataConfig:
    train_path: str = ""  # prompt dataset: .jsonl, .json or .parquet
    eval_path: str | None = None  # held-out prompts for evaluation (same format)
    prompt_key: str = "prompt"  # column holding the prompt (string or chat messages)
    max_prompt_length: int = 512  # prompts longer than this (in tokens) are bad rows
    on_bad_row: str = "error"  # "error": stop at the first bad row; "drop": skip and count them
    shuffle: bool = True  # reshuffle the prompts every epoch (deterministically from train.seed)
    # Preference / SFT column names (DPO, KTO, SFT, reward-model training).
    chosen_key: str = "chosen"  # preferred completion column (DPO, reward model)
    rejected_key: str = "rejected"  # dispreferred completion column (DPO, reward model)
    completion_key: str = "completion"  # completion column (KTO)
    label_key: str = "label"  # desirable/undesirable boolean column (KTO)
    response_key: str = "response"  # response column (SFT prompt/response data)
    messages_key: str = "messages"  # chat-messages column (SFT chat data)
    max_length: int = 1024  # prompt + completion token limit (offline algorithms)


@dataclass
class RolloutConfig:
    backend: str = "auto"  # "auto" (native on GPU where supported, else hf), "native" or "hf"
    n: int = 8  # responses sampled per prompt (the group size of GRPO / RLOO)
    max_tokens: int = 64  # most tokens generated per response
    temperature: float = 1.0  # sampling temperature; 0 means greedy
    top_p: float = 1.0  # nucleus sampling threshold; 1 disables it
    top_k: int = 0  # keep only the k most likely tokens; 0 disables it
    kv_cache_fraction: float = 0.3  # native engine: fraction of free GPU memory for the KV cache
    fp32_residual: bool = True  # native engine: carry the residual stream in fp32 (rollout log-probs closer to exact, hence to the trainer's)
    # native engine on CUDA: cascade attention, the n samples of a prompt read its shared KV blocks once per
    # decode step instead of n times (off until its speed is measured on a GPU; the results are the same)
    shared_prefix_attention: bool = False
    # native engine on CUDA: each decode product through the cuBLASLt algorithm timed fastest for its shape
    # (once, before the first decode graph), PyTorch's pick where none is faster
    tuned_products: bool = True
    # native engine on CUDA: a host check between decode chunks reads the rows' flags while the GPU runs the
    # next step, instead of the GPU waiting through the check (the samples are the same)
    step_ahead: bool = True
    eval_temperature: float = 0.0  # temperature for evaluation (0: greedy accuracy)


@dataclass
class RewardConfig:
    # Reward components, summed with their weights. Each entry is either a built-in scorer
    # {"name": "arith"} or a function {"function": "my_pkg.rewards:score" | "file.py:score"},
    # with optional "weight" (default 1.0) and "kwargs".
    functions: list[dict[str, Any]] = field(default_factory=lambda: [{"name": "arith"}])
    timeout_s: float | None = None  # per-sample time limit for reward functions; None: no limit
    num_workers: int = 0  # threads scoring in parallel with generation; 0 scores after rollout
    # The learned reward model of model.reward_model_path (a sequence classifier, e.g. from algorithm: rm).
    model_weight: float = 1.0  # its weight in the sum with reward.functions
    model_offload: bool = True  # keep its weights in CPU memory, streamed to the GPU layer by layer while scoring
    model_normalize: bool = False  # normalise its scores by their running mean and std
    model_clip: float | None = None  # clip its (normalised) scores to [-clip, clip]; None: no clipping
    model_max_batch_tokens: int = 4096  # padded tokens per reward-model forward pass


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # "grpo", "ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline", ...
    advantage: str | None = None  # advantage estimator; None picks the algorithm's default
    norm_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    gamma: float = 1.0  # discount factor (GAE, REINFORCE++)
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.0  # weight of the KL to the reference model; 0 loads no reference
    kl_estimator: str = "k3"  # "k1", "k2", "k3" (low-variance) or "abs"
    kl_in_reward: bool = False  # True: subtract kl_coef*KL from the reward; False: add it to the loss
    clip_low: float = 0.2  # PPO ratio clip below 1 (1 - clip_low)
    clip_high: float = 0.2  # PPO ratio clip above 1 (1 + clip_high); 0.28 is DAPO's clip-higher
    dual_clip: float | None = None  # dual-clip bound c > 1 for negative advantages; None disables
    entropy_coef: float = 0.0  # entropy bonus weight
    loss_agg: str = "token-mean"  # "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", ...
    value_clip: float | None = 0.2  # PPO value-function clip; None disables
    vf_coef: float = 1.0  # critic loss weight
    # Offline algorithms.
    beta: float = 0.1  # DPO / KTO temperature
    dpo_loss: str = "sigmoid"  # "sigmoid", "ipo" or "robust"
    label_smoothing: float = 0.0  # conservative DPO: assumed label-noise probability
    rpo_alpha: float = 0.0  # DPO: weight of an NLL term on the chosen responses (RPO); keeps their likelihood up
    desirable_weight: float = 1.0  # KTO weight of desirable examples
    undesirable_weight: float = 1.0  # KTO weight of undesirable examples
    rm_margin: float = 0.0  # reward model: margin added to the Bradley-Terry loss


@dataclass
class TrainConfig:
    total_steps: int = 100  # optimizer-update steps (one rollout batch per RL step)
    batch_size: int = 64  # responses per RL step (prompts per step = batch_size / rollout.n)
    mini_batch_size: int | None = None  # responses per optimizer step; None = batch_size
    micro_batch_size: int = 16  # responses per forward/backward (gradient accumulation)
    # Token budget per forward/backward: micro-batches are filled with responses up to this many
    # tokens (a packed prompt counts once per micro-batch) instead of micro_batch_size rows.
    # 0 or None keeps the fixed count. A response longer than the budget gets a micro-batch alone.
    max_tokens_per_micro_batch: int | None = None
    # Token budget of the forward passes without gradients (reference, old log-probs, values): they
    # hold no activations, so larger batches cost little memory and keep the GPU busier. None = the
    # training budget (max_tokens_per_micro_batch).
    max_tokens_per_forward: int | None = None
    packing: str = "auto"  # "on": each micro-batch is one row, each prompt once for its responses (no padding); "off"; "auto": on on GPU
    # The attention kernel for packed rows on a GPU: "flash" (PyTorch's FlashAttention-2 over variable-length
    # segments; sm80+, bf16/fp16), "flex" (FlexAttention with a block mask), "triton" (the same segments, forward
    # by a Triton kernel with each KV head's query heads in one tile, backward by FlashAttention-2), "triton_full" (that
    # forward with a Triton backward; correct, but measured slower than FlashAttention-2's backward), "fa4" (the same segments through
    # FlashAttention-4's CuTe kernels: pip install flash-attn-4; Hopper / Blackwell), "cudnn" (the same segments, forward by cuDNN's
    # fused SDPA, backward by FlashAttention-2: pip install nvidia-cudnn-frontend; sm80+, cuDNN >= 9.6), "cudnn_full" (cuDNN's backward too),
    # "auto": triton on Hopper (head dim 64 or 128), else flash where it runs, else flex
    packed_attention: str = "auto"
    # bf16/fp16 models: "fp32" master weights, gradients and AdamW state (18 B/param); "compensated": bf16
    # weights + bf16 Kahan compensation, bf16 moments and gradients (10 B/param, bf16 only); "none": AdamW in bf16
    master_weights: str = "fp32"
    offload_reference: bool = False  # keep the reference model in pinned CPU memory except during its forward pass
    # with offload_reference and compile_layers_per_graph > 1: copy the reference's weights stage by stage (the
    # embedding while the batch is laid out, the layers once its pass begins) and let each layer group of the pass
    # wait for its own weights only, instead of the pass waiting for the whole copy. Off: on an H200 the batch
    # phase got 9-57 ms shorter and the reference pass 10-36 ms longer (W0.5B no gain, W1.5B ~20 ms a step)
    stream_reference: bool = False
    # keep the optimizer's moments (and compensation) in pinned CPU memory except during optimizer.step():
    # less peak GPU memory (6 of compensated's 10 B/param), one host-to-GPU copy of that state per step
    offload_optimizer: bool = False
    # bf16 models: carry the policy's and reference's residual stream in fp32 (train/residual.py), as the
    # native rollout engine does (rollout.fp32_residual): log-probs closer to exact and to the rollout's;
    # with gradient checkpointing each layer's saved input takes fp32 instead of bf16
    fp32_residual: bool = False
    # The policy update's lm_head makes its gradient in its forward pass, since the policy loss's derivative
    # for a token is known once the token's log-prob is: each chunk of logits is computed once, not twice
    fused_logprob_grad: bool = True
    # CUDA, bf16 / fp16: the lm_head's chunk products (logits, weight gradient) run the cuBLASLt algorithm timed
    # fastest for their shape at start-up (~0.5 s once; saved in ~/.cache/hybridrl/cublaslt.json), not PyTorch's pick
    tuned_products: bool = True
    compile: bool = False  # torch.compile the decoder of the policy, reference and critic; for the native rollout backend (hf generate recompiles per shape)
    # Decoder layers per compiled graph (train.compile, packed rows, llama/mistral/qwen2/qwen3): 1 compiles
    # each layer (~3 compiled calls per layer per micro-batch); N > 1 runs groups of N layers with their
    # checkpointing as one graph (~2 calls per group): less host work per micro-batch, a longer first
    # compile, and up to N layers' gradients alive at once in the backward
    compile_layers_per_graph: int = 1
    # with compile_layers_per_graph > 1: compile the layer groups for any number of tokens from the first
    # call (dynamic token and segment dimensions), instead of once for the first micro-batch size and
    # again, dynamically, at the second; the first step compiles half as many graphs, and the later steps
    # were as fast (W0.5B, one H200: training phase 1.235-1.258 s against 1.256-1.268 s static)
    compile_dynamic: bool = True
    ppo_epochs: int = 1  # passes over each rollout batch
    lr: float = 1e-6  # actor learning rate
    critic_lr: float = 1e-5  # critic learning rate (PPO)
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    lr_schedule: str = "constant"  # "constant" or "cosine" (both with linear warmup)
    warmup_steps: int = 0  # linear warmup steps
    min_lr_ratio: float = 0.0  # cosine: final lr as a fraction of lr
    seed: int = 0  # seeds data order, sampling and initialisation
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    num_threads: int | None = None  # torch intra-op threads; None: torch's default on CPU, 1 with a GPU
    # GPU: deterministic kernels (torch.use_deterministic_algorithms, process-wide), so that two runs, or a run
    # and its resumed copy, end bit for bit alike; off, the packed attention's backward and the gradient of the
    # prompt keys gathered for each response add in whatever order their atomics land (CPU runs are deterministic either way).
    # Costs time on a GPU, all of it in the training phase and mostly the host's, so it varies by machine (W0.5B,
    # H200: 2.56 s a step against 2.42 s in one call, 2.391 against 2.389 s in another), and 0.2 GiB of peak memory.
    deterministic: bool = False
    max_skipped_steps: int = 5  # abort after this many consecutive updates with NaN/inf


@dataclass
class TrainerConfig:
    output_dir: str = "runs/hybridrl"  # metrics, checkpoints and the resolved config go here
    save_every: int = 50  # checkpoint every N steps (and at the end); 0 disables
    keep_last: int = 3  # checkpoints kept on disk (older ones are deleted)
    resume: str = "auto"  # "auto" (latest if present), "off", or a checkpoint directory path; going back sets
    # the later checkpoints and metrics records aside in <output_dir>/superseded-<UTC time>/ (nothing is deleted)
    eval_every: int = 0  # evaluate on data.eval_path every N steps; 0 disables
    eval_samples: int = 200  # held-out prompts used per evaluation
    progress: bool = True  # show a progress bar on the console
    # After the first step, and after any step that compiled, collect once and freeze what survives
    # (gc.freeze), so the Python collector's full collections, which stop the host, stay short.
    # Unfrozen when fit returns. See metrics/timing.py GcClock.
    gc_freeze: bool = True
    continue_on_save_error: bool = False  # keep training if a checkpoint or metrics record cannot be written
    # After SIGTERM/SIGINT the current step may run this long; if it has not started its update by
    # then it is abandoned. Keep it below the scheduler's kill delay (Slurm, Kubernetes: ~30 s).
    preemption_grace_s: float = 20.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
