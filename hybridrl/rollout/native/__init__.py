"""The native rollout backend: paged KV cache, continuous batching, shared prompt blocks for the
n samples of a prompt, CUDA-graph decode, on the trainer's own weights.

Files: arch (weight views, supported models) · kv_cache (blocks, allocator) · scheduler (admission)
· model (prefill / decode forward) · ops_torch (CPU ops, reference) · ops_triton, triton_* (GPU
kernels) · sampling · state (decode buffers) · cuda_graphs · backend (`NativeBackend`).
"""

from .arch import supports
from .backend import NativeBackend

__all__ = ["NativeBackend", "supports"]
