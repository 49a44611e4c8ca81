"""The decoder forward over the paged KV cache: prefill (whole prompts) and decode (one token per
running sequence). Weights are read from the HF module on every call (arch.DecoderWeights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .arch import DecoderWeights
from .fused import FusedWeights
from .kv_cache import PagedKVCache


class NativeDecoder:
    """Runs a supported HF decoder on the paged cache with a given set of decode ops."""

    def __init__(self, weights: DecoderWeights, ops, *, fp32_residual: bool = False):
        self.weights = weights
        # True: the residual stream is carried in fp32 (HF rounds it to the model dtype after every
        # add). Projections, attention and norms' outputs keep the model dtype either way.
        self.fp32_residual = fp32_residual
        self.spec = weights.spec
        self.ops = ops  # TorchOps (CPU) or TritonOps (CUDA)
        self.cos: torch.Tensor | None = None  # [P, D/2] fp32 rope tables
        self.sin: torch.Tensor | None = None
        self.fused: FusedWeights | None = None  # q|k|v and gate|up copies for decode (fused.py)
        self.prefix = None  # SharedPrefix tables: cascade attention over shared prompts (shared_prefix.py)
        self.kv_table = None  # CacheAddresses: the cache ops find the KV cache through it (kv_cache.py)
        # cublaslt.TunedProducts: the decode step's products through the cuBLASLt algorithm timed
        # fastest for each shape (tune_products); None: F.linear (PyTorch's pick) everywhere.
        self.products = None
        self._tuned_rows: set[int] = set()  # row counts tune_products has seen (eager steps ask every few steps)

    def prepare(self, max_positions: int) -> None:
        """(Re)builds the rope tables when longer contexts are needed than seen so far."""
        if self.cos is None or self.cos.shape[0] < max_positions:
            self.cos, self.sin = self.weights.rope_tables(max_positions)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b) if self.products is None else self.products.linear(x, w, b)

    def _qkv(self, h: torch.Tensor, layer: int, lw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q, k, v of rows h: one product of the fused q|k|v weight when there is one."""
        linear = self._linear
        if self.fused is None:
            return linear(h, lw.q_w, lw.q_b), linear(h, lw.k_w, lw.k_b), linear(h, lw.v_w, lw.v_b)
        q_size, kv_size = self.spec.num_heads * self.spec.head_dim, self.spec.num_kv_heads * self.spec.head_dim
        return linear(h, self.fused.qkv_w[layer], self.fused.qkv_b[layer]).split([q_size, kv_size, kv_size], -1)

    def _mlp(self, h: torch.Tensor, layer: int, lw) -> torch.Tensor:
        """A layer's down(SiLU(gate) * up) of rows h, gate|up as one product when fused."""
        fused, linear = self.fused, self._linear
        if fused is not None:
            gate, up = linear(h, fused.gate_up_w[layer]).split([fused.inter, fused.inter], -1)
        else:
            gate, up = linear(h, lw.gate_w), linear(h, lw.up_w)
        return linear(self.ops.silu_mul(gate, up), lw.down_w)

    def tune_products(self, rows: int) -> None:
        """Times the candidates for each product of a `rows`-row decode step (once per shape; see
        cublaslt.TunedProducts). Call outside graph capture, before capturing that step."""
        if self.products is None or rows in self._tuned_rows:
            return
        self._tuned_rows.add(rows)
        layers = list(self.weights.layers())

        def each(attr: str) -> list[torch.Tensor] | None:  # every layer's tensor, None where the model has none
            return None if getattr(layers[0], attr) is None else [getattr(lw, attr) for lw in layers]

        groups = [(each("o_w"), each("o_b")), (each("down_w"), None), ([self.weights.lm_head], None)]
        if self.fused is not None:
            groups += [(self.fused.qkv_w, self.fused.qkv_b if self.fused.has_bias else None), (self.fused.gate_up_w, None)]
        else:
            groups += [(each(f"{name}_w"), each(f"{name}_b")) for name in "qkv"]
            groups += [(each("gate_w"), None), (each("up_w"), None)]
        for weights, biases in groups:
            self.products.tune(rows, weights, biases)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,  # [P, L] right-padded prompts
        lengths: torch.Tensor,  # [P] int64
        slots: torch.Tensor,  # [P, L] int64 cache slot of each token (ignored where padded)
        cache: PagedKVCache,
        valid_index: torch.Tensor,  # [N] int64: flat places (p * L + t) of the real tokens
    ) -> torch.Tensor:
        """Writes the prompts' K/V to the cache; returns fp32 logits of each last token [P, V].

        Right padding needs no mask under causal attention: a real token only sees earlier
        positions, which are all real; padded positions compute garbage nobody reads. Only the real
        tokens' K/V reach the cache: the Triton kernel checks each token against `lengths`, the
        PyTorch ops pick them by `valid_index` (an index, not a boolean mask, since a mask's result
        size is known only after a device-to-host sync; the engine builds it on the host). The
        layers run the decode step's ops (add + RMSNorm, fused q|k|v and gate|up, SiLU * up) with
        every token as a row, so the prefill rounds where the decode step does.
        """
        spec, w, ops = self.spec, self.weights, self.ops
        num_prompts, length = input_ids.shape
        d = spec.head_dim
        # On CUDA ~10 kernels a layer, where plain PyTorch ops took ~55: the prefill's time was its
        # host's launches (NOTES.md here, session 18).
        x = F.embedding(input_ids.flatten(), w.embed)  # [P * L, H]
        residual = x.new_zeros(x.shape, dtype=torch.float32) if self.fp32_residual else None
        for layer, lw in enumerate(w.layers()):
            h, residual = ops.add_rms_norm(x, residual, lw.input_norm, spec.rms_eps)
            q, k, v = self._qkv(h, layer, lw)
            q, k = ops.prefill_rope_write_kv(
                q, k, v, lengths, slots, valid_index, self.cos, self.sin, lw.q_norm, lw.k_norm, spec.rms_eps,
                cache.k[layer], cache.v[layer],
            )  # fmt: skip
            attn = F.scaled_dot_product_attention(
                q.view(num_prompts, length, -1, d).transpose(1, 2), k.view(num_prompts, length, -1, d).transpose(1, 2),
                v.reshape(num_prompts, length, -1, d).transpose(1, 2), is_causal=True, scale=spec.scaling, enable_gqa=True,
            )  # fmt: skip
            x = F.linear(attn.transpose(1, 2).reshape(num_prompts * length, -1), lw.o_w, lw.o_b)
            h, residual = ops.add_rms_norm(x, residual, lw.post_norm, spec.rms_eps)
            x = self._mlp(h, layer, lw)
        last = torch.arange(num_prompts, device=x.device) * length + lengths - 1  # each prompt's last token
        h, _ = ops.add_rms_norm(x[last], residual[last], w.final_norm, spec.rms_eps)
        return F.linear(h, w.lm_head).float()

    def decode(
        self,
        tokens: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64, position of `tokens`
        block_tables: torch.Tensor,  # [B, MB] int32
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """One decode step for B sequences; returns logits [B, V] in the model dtype."""
        spec, w, ops = self.spec, self.weights, self.ops
        x = F.embedding(tokens, w.embed)  # [B, H]
        residual = x.new_zeros(x.shape, dtype=torch.float32) if self.fp32_residual else None
        for layer, lw in enumerate(w.layers()):
            h, residual = ops.add_rms_norm(x, residual, lw.input_norm, spec.rms_eps)
            q, k, v = self._qkv(h, layer, lw)
            attn = ops.rope_decode_attention(
                q, k, v, positions, self.cos, self.sin, lw.q_norm, lw.k_norm, spec.rms_eps,
                cache.k[layer], cache.v[layer], block_tables, spec.scaling, prefix=self.prefix,
                kv_table=None if self.kv_table is None else self.kv_table.layer(layer),
            )  # fmt: skip
            x = self._linear(attn, lw.o_w, lw.o_b)
            h, residual = ops.add_rms_norm(x, residual, lw.post_norm, spec.rms_eps)
            x = self._mlp(h, layer, lw)
        h, _ = ops.add_rms_norm(x, residual, w.final_norm, spec.rms_eps)
        return self._linear(h, w.lm_head)
