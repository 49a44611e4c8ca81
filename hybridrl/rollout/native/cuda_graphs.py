"""Decode steps captured as CUDA graphs, one per batch-size bucket and sampling setting.

Replaying a graph launches the step's ~300 kernels with one call, which is what makes a small
model's decode fast (BENCHMARK.md: 18.3 ms eager vs 5.1 ms graphed for the same step). Graphs are
captured lazily, on the first step that needs a bucket, and bake in the addresses of the weights,
the KV cache and the DecodeState buffers: the owner drops them when any of those move.
"""

from __future__ import annotations

import time

from typing import Callable

import torch

from .sampling import SamplingParams

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, step: Callable[[int, SamplingParams], None], snapshot, restore, buckets=DEFAULT_BUCKETS,
                 prepare: Callable[[int], None] | None = None):  # fmt: skip
        self.step = step  # step(batch, params): one decode step over rows [0, batch)
        self.prepare = prepare  # prepare(batch): before a bucket's first warm-up (e.g. choosing its products' algorithms)
        self.snapshot, self.restore = snapshot, restore  # undo the warm-up steps' state updates
        self.buckets = sorted(buckets)
        self.graphs: dict[tuple[int, SamplingParams], torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for all graphs (they never run concurrently)
        # One side stream for every warm-up and capture: cuBLAS keeps a workspace per stream, so a
        # new stream per capture would leak one workspace per sleep / wake cycle.
        self.stream: torch.cuda.Stream | None = None
        self.capture_s = 0.0  # host seconds spent warming up and capturing, over the object's life

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"decode batch {batch} exceeds the largest graph bucket {self.buckets[-1]}")

    def run(self, batch: int, params: SamplingParams, num_steps: int) -> None:
        """Runs num_steps decode steps over at least `batch` rows (padded to a bucket)."""
        bucket = self.bucket(batch)
        key = (bucket, params)
        graph = self.graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            graph = self.graphs[key] = self._capture(bucket, params)
            self.capture_s += time.perf_counter() - start
        for _ in range(num_steps):
            graph.replay()

    def _capture(self, bucket: int, params: SamplingParams) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), restoring the
        # state after each step so that capture starts from the rows as they were.
        saved = self.snapshot()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if self.prepare is not None:  # on the capture stream: no other stream's cuBLAS workspace
                self.prepare(bucket)
            for _ in range(2):
                self.step(bucket, params)
                self.restore(saved)
        torch.cuda.current_stream().wait_stream(self.stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            self.step(bucket, params)
        return graph

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None
