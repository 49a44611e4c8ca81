"""`NativeBackend`: hybridrl's own generation engine (the `native` rollout backend).

The loop of one generate call, top to bottom:
    queue every prompt group -> [admit groups that fit (slots, KV blocks, token budget)
    -> prefill them, sample each sample's first token, fork the n samples onto the shared prompt
    blocks -> run decode steps on the device (CUDA graphs) until a row may have finished
    -> collect finished rows, free their blocks, stream them to on_finished, compact] -> repeat.
The weights are the HF module's own tensors (no copy); the KV cache lives between wake() and
sleep().
"""

from __future__ import annotations

import time

import torch

from hybridrl.models.loading import to_device

from ..types import GeneratedSequence, GenerationRequest, OnFinished, order_sequences
from .arch import DecoderWeights, supports
from .cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from .fused import FusedWeights, fuse_parameters
from .kv_cache import CacheAddresses, PagedKVCache
from .model import NativeDecoder
from .ops_torch import TorchOps
from .sampling import SamplingParams, row_keys_from_seeds
from .scheduler import PromptGroup, RunningSequence, Scheduler, blocks_for
from .shared_prefix import SharedPrefix
from .state import DecodeState

MAX_STOP_IDS = 32


class NativeBackend:
    """Paged-KV, continuously batched generation over a HF Llama / Qwen2 / Qwen3 / Mistral model."""

    name = "native"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,  # unused: the facade tokenises; kept for the backend constructor signature
        *,
        kv_cache_fraction: float = 0.3,  # of free GPU memory at wake(); ignored on CPU
        block_size: int = 16,  # tokens per KV block
        max_batch_tokens: int = 16384,  # padded prompt tokens per prefill
        max_num_seqs: int = 512,  # sequences decoded at once
        cuda_graphs: bool = True,
        sync_every: int = 16,  # decode steps between host checks when stop tokens can end rows
        num_kv_blocks: int | None = None,  # fixed cache size (overrides kv_cache_fraction)
        fuse_weights: bool | None = None,  # q|k|v, gate|up as one tensor each, shared in place (fused.py); default: on GPU
        fp32_residual: bool = True,  # carry the residual stream in fp32 (model.NativeDecoder)
        # Cascade attention: the n samples of a prompt read its shared KV blocks once per decode step
        # (shared_prefix.py); CUDA only (the Triton kernels). Off until measured on a GPU.
        shared_prefix_attention: bool = False,
        shared_prefix_splits: int = 0,  # programs per group's shared prefix; 0: chosen per batch (SharedPrefix.splits)
        # sleep() frees the KV cache but keeps the captured decode graphs and the small buffers they
        # read (decode state, rope tables, cuBLAS workspaces, the graphs' own memory pool of one
        # step's activations and logits); the next generate replays them: the kernels find the new
        # KV cache through an address table (kv_cache.CacheAddresses). Captured again only when
        # another address they baked in changed (e.g. a weight tensor replaced).
        keep_graphs: bool = True,
        # CUDA: each decode product through the cuBLASLt algorithm that ran fastest for its shape over
        # the layers' own weights (timed once per shape before the first graph capture; hybridrl/kernels/cublaslt.py),
        # PyTorch's pick where none beat it. Same products; a different split of K can round differently.
        tuned_products: bool = True,
        # with tuned_products: time each cuBLASLt answer's split-K / reduction / swizzle variants too (~2 s
        # more tuning once; no faster product found at W0.5B, so off)
        tuned_product_variants: bool = False,
        # A host check between decode chunks reads the rows' done flags and step counts as of the chunk's
        # end while the GPU already runs the next step, so the GPU does not wait through the check (only
        # when every running row has a token left; rows found done were frozen through that step).
        # Default: on CUDA (on CPU it changes nothing but the order of work; tests turn it on there).
        step_ahead: bool | None = None,
    ):
        if not 0.0 < kv_cache_fraction < 1.0:
            raise ValueError(f"kv_cache_fraction ({kv_cache_fraction}) must be in (0, 1)")
        self.weights = DecoderWeights(model)
        self.device = self.weights.device
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            from .ops_triton import TritonOps  # Triton is only needed (and present) on CUDA

            ops = TritonOps()
        else:
            ops = TorchOps()
        self.decoder = NativeDecoder(self.weights, ops, fp32_residual=fp32_residual)
        self.tuned_products = tuned_products and self.on_cuda
        if self.tuned_products:
            from hybridrl.kernels.cublaslt import TunedProducts

            self.decoder.products = TunedProducts(variants=tuned_product_variants)
        self.kv_cache_fraction = kv_cache_fraction
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_slots = max_num_seqs
        self.use_graphs = cuda_graphs and self.on_cuda
        self.sync_every = sync_every
        self.step_ahead = self.on_cuda if step_ahead is None else step_ahead
        self._flags_host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned copies of done / steps
        self.num_kv_blocks = num_kv_blocks
        self.fuse_weights = self.on_cuda if fuse_weights is None else fuse_weights
        if self.fuse_weights:
            # q/k/v and gate/up parameters become row slices of one tensor each: the decode step
            # reads them fused with no copy (fused.py). Optimizers must be built after this.
            fuse_parameters(model.model.layers)
        self.shared_prefix_attention = shared_prefix_attention
        self.shared_prefix_splits = shared_prefix_splits
        self.keep_graphs = keep_graphs
        self.cache: PagedKVCache | None = None
        self.state: DecodeState | None = None
        self.stats: dict[str, float] = {}  # where the last generate() spent its time (generate's docstring)
        prepare = self.decoder.tune_products if self.tuned_products else None
        self.graphs = DecodeGraphs(self._graph_step, self._snapshot, self._restore, buckets, prepare=prepare)
        self._graph_key: tuple | None = None  # addresses the captured graphs were built on

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return supports(model)

    # ---- memory phases -------------------------------------------------------------------------

    def wake(self) -> None:
        """Allocates the KV cache (kv_cache_fraction of free GPU memory; on CPU, lazily per request)."""
        if self.cache is None and self.on_cuda:
            self._allocate_cache(self._gpu_num_blocks())

    def sleep(self) -> None:
        """Frees the KV cache. Unless graphs are kept (`keep_graphs`, and the fused weights are
        views, not copies), also the decode buffers, fused weight copies, graphs and rope tables."""
        fused = self.decoder.fused
        keep = self.keep_graphs and self.use_graphs and bool(self.graphs.graphs) and (fused is None or fused.copied == 0)
        self.cache = None
        if not keep:
            self.graphs.clear()
            self.state = None
            self.decoder.cos = self.decoder.sin = self.decoder.fused = self.decoder.prefix = self.decoder.kv_table = None
            self._graph_key = None
        if self.on_cuda:
            if not keep:
                # cuBLAS workspaces live in PyTorch's allocator (one per stream, ours included); the
                # next matmul re-creates the ones it needs. Kept graphs point at theirs.
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()  # a graph's memory pool stays with its graph

    def _gpu_num_blocks(self) -> int:
        s = self.weights.spec
        limit = PagedKVCache.max_blocks(s.num_kv_heads, self.block_size, s.head_dim)
        if self.num_kv_blocks is not None:
            if self.num_kv_blocks > limit:
                raise ValueError(
                    f"num_kv_blocks={self.num_kv_blocks:,} makes each layer's K and V cache "
                    f"{self.num_kv_blocks * s.num_kv_heads * self.block_size * s.head_dim:,} elements, more than the "
                    f"decode kernels' 32-bit offsets reach ({PagedKVCache.MAX_LAYER_ELEMENTS:,}); "
                    f"set num_kv_blocks to at most {limit:,}"
                )
            return self.num_kv_blocks
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = PagedKVCache.bytes_per_block(
            s.num_layers, s.num_kv_heads, self.block_size, s.head_dim, self.weights.dtype
        )
        # A model with few layers on a large GPU would otherwise size a layer's cache past 32-bit offsets.
        return min(int(self.kv_cache_fraction * free) // per_block, limit)

    def _allocate_cache(self, num_blocks: int) -> None:
        s = self.weights.spec
        self.cache = None  # free the old one first
        self.cache = PagedKVCache(
            s.num_layers, num_blocks, s.num_kv_heads, self.block_size, s.head_dim,
            self.weights.dtype, self.device,
        )  # fmt: skip
        if self.use_graphs and self.decoder.ops.reads_cache_through_table:
            # Captured graphs read the cache through the table, which now points at the new cache.
            # (Without it, graphs captured on the old cache are dropped by _prepare's address check.)
            if self.decoder.kv_table is None:
                self.decoder.kv_table = CacheAddresses(s.num_layers, self.weights.dtype, self.device)
            self.decoder.kv_table.point_at(self.cache)

    # ---- generate ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, request: GenerationRequest, on_finished: OnFinished | None = None) -> list[GeneratedSequence]:
        """Generates every request's samples. `self.stats` then holds where this call's time went
        (host wall seconds between the loop's own host syncs, so measuring adds none): `prepare_s`
        (wake, buffers), `prefill_s`, `decode_s` (graph replays or eager steps, with the host checks
        that follow them), `capture_s` (CUDA-graph warm-up and capture, inside decode_s), `host_syncs`,
        `graphs_reused` (1 when the call started with decode graphs captured by an earlier one)."""
        start = time.perf_counter()
        self.stats = {"prepare_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "host_syncs": 0, "graphs_reused": 0.0}
        captured_before = self.graphs.capture_s
        max_tokens = self._check(request)
        params = SamplingParams(request.temperature, request.top_p, request.top_k)
        n, bs = request.n, self.block_size
        prompt_lens = [len(p) for p in request.prompt_ids]
        max_context = max(lp + m for lp, m in zip(prompt_lens, max_tokens))
        self._prepare(request, max_tokens, max_context)
        self.stats["prepare_s"] = time.perf_counter() - start
        base_seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, ()).item())

        sched = Scheduler(self.cache.allocator, bs, self.max_slots, self.max_batch_tokens)
        for i, ids in enumerate(request.prompt_ids):
            sched.add(PromptGroup(i, list(ids), max_tokens[i], n))
        stop_set = set(request.stop_token_ids)
        results: list[GeneratedSequence] = []
        remaining: dict[int, int] = {}  # slot -> tokens left before max_tokens, as of the last check
        stats = self.stats
        while sched.waiting or sched.running:
            t0 = time.perf_counter()
            groups = sched.admit()
            if groups:  # (nothing changed since the last check otherwise: no host sync needed)
                self._prefill(groups, sched, params, base_seed, n)
                self._collect(sched, stop_set, results, on_finished, remaining)
            t1 = time.perf_counter()
            stats["prefill_s"] += t1 - t0
            if not sched.running:
                assert groups, "a waiting prompt fits an empty cache (checked by Scheduler.add)"
                continue
            # Run until the first row can hit max_tokens; with stop tokens, check every few steps.
            num_steps = min(remaining.values())
            if stop_set:
                num_steps = min(num_steps, self.sync_every)
            self._decode(sched.batch_rows, params, num_steps)
            # Every running row still has a token left after these steps: the check may run one step ahead.
            ahead = self.step_ahead and min(remaining.values()) > num_steps
            self._collect(sched, stop_set, results, on_finished, remaining, ahead=params if ahead else None)
            stats["decode_s"] += time.perf_counter() - t1
        assert self.cache.allocator.num_free == self.cache.num_blocks - 1, "KV blocks leaked"
        stats["capture_s"] = self.graphs.capture_s - captured_before
        return order_sequences(results)

    def _check(self, request: GenerationRequest) -> list[int]:
        num = len(request.prompt_ids)
        max_tokens = list(request.max_tokens)
        if len(max_tokens) == 1 and num > 1:
            max_tokens = max_tokens * num
        if len(max_tokens) != num:
            raise ValueError(f"max_tokens has {len(max_tokens)} entries for {num} prompts; give one per prompt")
        if any(m < 1 for m in max_tokens):
            raise ValueError("every max_tokens must be >= 1")
        if any(len(p) == 0 for p in request.prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        if request.n < 1 or request.n > self.max_slots:
            raise ValueError(f"n ({request.n}) must be in [1, max_num_seqs={self.max_slots}]")
        if request.temperature < 0:
            raise ValueError(f"temperature ({request.temperature}) must be >= 0")
        if len(request.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop tokens are supported")
        window = self.weights.spec.sliding_window
        longest = max(len(p) + m for p, m in zip(request.prompt_ids, max_tokens))
        if window is not None and longest > window:
            raise ValueError(
                f"prompt + max_tokens ({longest}) exceeds the model's sliding window ({window}), "
                "which the native backend does not implement; use backend='hf'"
            )
        return max_tokens

    def _prepare(self, request: GenerationRequest, max_tokens: list[int], max_context: int) -> None:
        """Allocates what this request needs and drops graphs whose baked addresses moved."""
        bs, n = self.block_size, request.n
        if self.on_cuda:
            self.wake()
        else:  # CPU: size the cache from the request (all groups at once, no waiting)
            need = 1 + sum(
                shared + own * n
                for shared, own in (blocks_for(len(p), m, n, bs) for p, m in zip(request.prompt_ids, max_tokens))
            )
            if self.cache is None or self.cache.num_blocks < need:
                self._allocate_cache(need)
        max_blocks = -(-max_context // bs)
        if self.state is None or not self.state.fits(self.max_slots, max_blocks, max(max_tokens), MAX_STOP_IDS):
            old = self.state
            self.state = None
            self.state = DecodeState(
                self.max_slots, max(max_blocks, old.max_blocks_per_seq if old else 0),
                max(max(max_tokens), old.max_gen if old else 0), MAX_STOP_IDS, self.device,
            )  # fmt: skip
        self.state.set_stop_ids(list(request.stop_token_ids))
        self.decoder.prepare(max_context)
        if self.shared_prefix_attention and n > 1 and self.decoder.ops.shared_prefix:
            s = self.weights.spec
            prefix = self.decoder.prefix
            shape = (self.max_slots, n, s.num_heads, s.num_kv_heads, s.head_dim)
            if prefix is None or not prefix.fits(*shape, self.shared_prefix_splits):
                self.decoder.prefix = None
                self.decoder.prefix = SharedPrefix(*shape, self.device, self.shared_prefix_splits)
        else:
            self.decoder.prefix = None
        if self.fuse_weights:
            layers = self.weights.layers()
            if self.decoder.fused is None:
                self.decoder.fused = FusedWeights(layers)
            else:
                self.decoder.fused.refresh(layers)  # views stay views; copies take the latest weights
        key = self._addresses()
        if key != self._graph_key:
            self.graphs.clear()
            self._graph_key = key
        elif self.graphs.graphs:
            self.stats["graphs_reused"] = 1.0

    def _addresses(self) -> tuple:
        """Every device address a captured decode step reads or writes: the graphs are valid exactly
        as long as these stay the same."""
        d = self.decoder
        cache = [self.cache.k, self.cache.v] if d.kv_table is None else d.kv_table.tensors()
        tensors = [*cache, d.cos, d.sin, *self.state._buffers(), self.state.stop_ids]
        if d.fused is not None:
            tensors += d.fused.tensors()
        if d.prefix is not None:
            tensors += [t for t in vars(d.prefix).values() if isinstance(t, torch.Tensor)]
        return tuple(t.data_ptr() for t in tensors) + tuple(t.data_ptr() for t in self.weights.tensors())

    def _prefill(self, groups: list[PromptGroup], sched: Scheduler, params: SamplingParams, base_seed: int, n: int) -> None:
        bs, dev = self.block_size, self.device
        lengths = [len(g.prompt_ids) for g in groups]
        width = max(lengths)
        ids = torch.zeros(len(groups), width, dtype=torch.int64)
        slots = torch.zeros(len(groups), width, dtype=torch.int64)
        real = []  # the real tokens' flat places (r * width + t): the prefill picks them without a host sync
        for r, g in enumerate(groups):
            table = torch.tensor(g.block_table(0), dtype=torch.int64)
            pos = torch.arange(lengths[r])
            ids[r, : lengths[r]] = torch.tensor(g.prompt_ids)
            slots[r, : lengths[r]] = table[pos // bs] * bs + pos % bs
            real.append(r * width + pos)
        valid_index = torch.cat(real)
        logits = self.decoder.prefill(
            to_device(ids, dev), to_device(torch.tensor(lengths), dev), to_device(slots, dev), self.cache,
            valid_index=to_device(valid_index, dev),
        )  # fmt: skip
        # Copy-on-write: the prompt's partial last block was written into sample 0's first own
        # block; every other sample gets its own copy before it appends to it.
        src = [g.sample_blocks[0][0] for g in groups if len(g.prompt_ids) % bs for _ in range(1, n)]
        dst = [g.sample_blocks[j][0] for g in groups if len(g.prompt_ids) % bs for j in range(1, n)]
        self.cache.copy_blocks(src, dst)

        seqs = [seq for g in groups for seq in sched.start(g)]
        seeds = torch.tensor([base_seed + s.group.prompt_index * n + s.sample_index for s in seqs], device=dev)
        row_keys = row_keys_from_seeds(seeds)
        first_tokens, first_logprobs = self.decoder.ops.sample(
            logits.repeat_interleave(n, dim=0), row_keys, torch.zeros_like(seeds), params
        )
        self.state.start_rows(
            [s.slot for s in seqs], first_tokens, first_logprobs,
            [len(s.group.prompt_ids) for s in seqs], [s.group.block_table(s.sample_index) for s in seqs],
            row_keys, [s.group.max_tokens for s in seqs],
        )  # fmt: skip

    def _decode(self, batch: int, params: SamplingParams, num_steps: int) -> None:
        if self.use_graphs:
            self.graphs.run(batch, params, num_steps)
        else:
            if self.tuned_products:
                self.decoder.tune_products(batch)  # the products graphed steps of this size would run
            for _ in range(num_steps):
                self.state.step(batch, self.decoder, self.cache, params)

    def _collect(self, sched: Scheduler, stop_set: set[int], results: list, on_finished, remaining: dict,
                 ahead: SamplingParams | None = None) -> None:  # fmt: skip
        """Retires finished rows (one host sync), streams them out, and compacts the batch.

        `ahead`: the flags are read as of now while one more decode step (with these sampling
        parameters) runs over the same rows; rows found done were frozen through it (`advance`), the
        others are one token further on than the counts read, which `remaining` accounts for."""
        rows = sched.batch_rows
        if rows == 0:
            return
        self.stats["host_syncs"] += 1
        state = self.state
        if ahead is None:
            done = state.done[:rows].tolist()  # plain lists: indexing a CPU tensor per row costs ~us each
            steps = state.steps[:rows].tolist()
        else:
            done, steps = self._flags_then_step(rows, ahead)
        extra = 0 if ahead is None else 1
        finished = sorted(s for s in sched.running if done[s])
        if finished:
            idx = torch.tensor(finished, device=self.device)
            tokens, logprobs = state.out_tokens[idx].cpu(), state.out_logprobs[idx].cpu()
            seqs = [sched.finish(slot) for slot in finished]
            for slot in finished:
                remaining.pop(slot, None)
            for out in finished_sequences(seqs, tokens, logprobs, [steps[slot] for slot in finished], stop_set):
                results.append(out)
                if on_finished is not None:
                    on_finished(out)
            state.reset_rows(finished)
        for slot, seq in sched.running.items():
            remaining[slot] = seq.group.max_tokens - steps[slot] - extra
        src, dst = sched.compaction()
        if src:
            state.move_rows(src, dst)
            state.reset_rows(src)
            for s, d in zip(src, dst):
                remaining[d] = remaining.pop(s)
        if self.decoder.prefix is not None:  # rows started, finished or moved: who shares what
            self.decoder.prefix.update(sched.running, self.block_size)

    def _flags_then_step(self, rows: int, params: SamplingParams) -> tuple[list[bool], list[int]]:
        """(done, steps) of rows [0, rows) as they are now, and one more decode step queued behind their
        copy: on CUDA the host reads the copy (pinned memory, an event) while the GPU runs the step."""
        state = self.state
        if not self.on_cuda:
            done, steps = state.done[:rows].tolist(), state.steps[:rows].tolist()
            self._decode(rows, params, 1)
            return done, steps
        if self._flags_host is None or self._flags_host[0].numel() < state.max_slots:
            self._flags_host = (torch.empty(state.max_slots, dtype=torch.bool, pin_memory=True),
                                torch.empty(state.max_slots, dtype=torch.int64, pin_memory=True))  # fmt: skip
        done_h, steps_h = self._flags_host
        done_h[:rows].copy_(state.done[:rows], non_blocking=True)
        steps_h[:rows].copy_(state.steps[:rows], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._decode(rows, params, 1)
        copied.synchronize()
        return done_h[:rows].tolist(), steps_h[:rows].tolist()

    # ---- CUDA graph hooks ----------------------------------------------------------------------

    def _graph_step(self, batch: int, params: SamplingParams) -> None:
        self.state.step(batch, self.decoder, self.cache, params)

    def _snapshot(self):
        return self.state.snapshot()

    def _restore(self, saved) -> None:
        self.state.restore(saved)


def finished_sequences(
    seqs: list[RunningSequence], tokens: torch.Tensor, logprobs: torch.Tensor, lengths: list[int], stop_set: set[int]
) -> list[GeneratedSequence]:
    """The finished rows as `GeneratedSequence`s: row r of `tokens` / `logprobs` (CPU, `[F, >= max
    length]`) holds `seqs[r]`'s first `lengths[r]` tokens and their log-probs.

    Rows are read as numpy slices: a torch slice and `.tolist()` per row cost 1.4 ms more at 256 rows."""
    tokens, logprobs = tokens.numpy(), logprobs.numpy()
    out = []
    for seq, row_tokens, row_logprobs, length in zip(seqs, tokens, logprobs, lengths):
        response = row_tokens[:length].tolist()
        out.append(GeneratedSequence(
            prompt_index=seq.group.prompt_index,
            sample_index=seq.sample_index,
            response_ids=response,
            response_logprobs=row_logprobs[:length].tolist(),
            finish_reason="stop" if response[-1] in stop_set else "length",
            arrays=(row_tokens[:length], row_logprobs[:length]),
        ))  # fmt: skip
    return out
