"""Matrix products through cuBLASLt with the algorithm chosen by timing.

PyTorch's bf16 products run cuBLASLt's first heuristic answer. At the decode step's shapes (a few
hundred rows against one layer's weight) that answer is a guess about a product that takes a few
microseconds: at W0.5B's gate|up (256 x 9728 x 896) it picks 168 x 128 tiles, 152 of them on 132
SMs, so a second wave of 20 tiles runs alone. cuBLASLt returns more candidates when asked; this
module asks for them (`LtProduct.candidates`), times them where the engine runs them (a CUDA graph
over every layer's own weight, so the weights stream from HBM), and runs the fastest.

The decode step's products are tuned by `TunedProducts` (timed in CUDA graphs, a few microseconds
each); larger products of fixed shape, such as the trainer's lm_head chunks, by `tune_product` (timed
eagerly on the caller's stream) and looked up with `tuned_product`.

ctypes over the cuBLASLt library PyTorch already loaded: no build step, and on a machine without
CUDA the module imports and `available()` says False. The calls are capturable in CUDA graphs (the
workspace is allocated up front; alpha and beta are host scalars read at capture).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
from dataclasses import dataclass

import torch

# cublasLt.h / library_types.h values (stable across CUDA 11.4-13).
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_SM_COUNT_TARGET = 3, 4, 7, 8, 15
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "inner": 7, "cluster": 8}
_CONFIG_U16 = {7, 8}  # inner shape and cluster shape ids are uint16_t (cublasLt.h, CUDA 12+); the others uint32_t / int32_t
_CONFIG_SPLITK, _CONFIG_REDUCTION, _CONFIG_SWIZZLE = 2, 3, 4
_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_MASK, _CAP_SWIZZLE_SUPPORT = 0, 1, 2
# cublasLtReductionScheme_t: how split-K parts are summed. In place adds them into the output in a fixed
# order (the workspace only holds the counters that order them), the others sum fp32 / output-type
# partials from the workspace in a second kernel.
_REDUCTION_NAMES = {1: "inplace", 2: "compute", 4: "output"}
# Split-K counts tried for each heuristic answer (LtProduct(variants=True)).
VARIANT_SPLITS = (1, 2, 3, 4, 6, 8, 16)
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """The cuBLASLt library PyTorch loaded (found in this process's maps), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    for name in ([path] if path else []) + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic), ctypes.POINTER(i32)]
        lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)]
        lib.cublasLtMatmulAlgoConfigSetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz]
        lib.cublasLtMatmulAlgoCapGetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)]
        lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)]
        for fn in ("cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy", "cublasLtMatmulPreferenceDestroy"):
            getattr(lib, fn).argtypes = [vp]
            getattr(lib, fn).restype = i32
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        lib.cublasLtGetVersion.argtypes = []
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp]
        for fn in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate",
                   "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                   "cublasLtMatmulAlgoConfigGetAttribute", "cublasLtMatmulAlgoConfigSetAttribute",
                   "cublasLtMatmulAlgoCapGetAttribute", "cublasLtMatmulAlgoCheck", "cublasLtMatmul"):  # fmt: skip
            getattr(lib, fn).restype = i32
        return lib
    return None


def available() -> bool:
    return _lib() is not None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus_t {status}")


@functools.lru_cache(maxsize=None)
def _handle(device: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


_workspaces: dict[int, list[torch.Tensor]] = {}  # per device, every workspace handed out (graphs keep their addresses)
_scratch: dict[int, torch.Tensor] = {}  # per device, WORKSPACE_BYTES for timing candidates; freed after tuning


def _workspace(device: int, nbytes: int) -> torch.Tensor | None:
    """A workspace of at least `nbytes` for the products kept after tuning: the largest handed out
    so far, or a new one where that is too small. Old ones stay allocated, since a captured graph
    may point at them; each is only as large as the algorithm that asked for it needs (a split-K
    product's partial sums, ~3 MB at W0.5B), not the 32 MiB the heuristic may plan with."""
    if nbytes <= 0:
        return None
    held = _workspaces.setdefault(device, [])
    if not held or held[-1].numel() < nbytes:
        held.append(torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}"))
    return held[-1]


def _scratch_workspace(device: int) -> torch.Tensor:
    ws = _scratch.get(device)
    if ws is None:
        ws = _scratch[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
    return ws


def release_scratch() -> None:
    """Frees the timing workspace (tuning is over; kept products have their own)."""
    _scratch.clear()


@dataclass(frozen=True)
class Candidate:
    index: int  # rank in cuBLASLt's heuristic answer (0 with sm_target 0: what PyTorch runs)
    sm_target: int  # the SM count the heuristic was asked to plan for (0: the device's)
    algo: _Algo
    workspace: int
    waves: float
    config: dict  # the algorithm's configuration attributes, for reports
    variant: str = ""  # "" for the heuristic's own answer; else what was changed in it (split-K, reduction, swizzle)

    @property
    def is_pytorch_pick(self) -> bool:
        """The algorithm PyTorch's product runs: the heuristic's first answer for the device, unchanged."""
        return self.index == 0 and self.sm_target == 0 and not self.variant

    def describe(self) -> str:
        c = self.config
        target = f"@{self.sm_target}SM " if self.sm_target else ""
        variant = f" ({self.variant})" if self.variant else ""
        return (f"{target}#{self.index}{variant} tile {c.get('tile')} splitK {c.get('splitk')} red {c.get('reduction')} "
                f"swizzle {c.get('swizzle')} stages {c.get('stages')} cluster {c.get('cluster')} waves {self.waves:.2f}")


class LtProduct:
    """out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) for one shape and dtype, through cuBLASLt.

    `candidates` are cuBLASLt's heuristic answers for the shape (first = PyTorch's choice); `algo`
    is the one `__call__` runs (set it from `choose`). The other layouts of a linear layer's backward
    (bench/decode_gemm.py --lt-layout): `x_transposed` takes x as [K, M] storage (x.t() multiplied),
    `w_transposed=False` takes w as [K, N] storage (multiplied as it is). `accumulate` adds the
    product to `out` (beta = 1: out += x @ w.T), as `addmm_` does; `out` must then be given.

    `variants` adds, for each heuristic answer, the same kernel with the other split-K counts
    (VARIANT_SPLITS), reduction schemes and CTA swizzle its capabilities allow, each one checked by
    cuBLASLt (`cublasLtMatmulAlgoCheck`) for this shape before it becomes a candidate: the heuristic
    answers one configuration per kernel, and at a few hundred rows the split of K is what decides
    how many SMs a small product keeps busy.
    """

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, *, bias: bool, device: int | None = None,
                 max_candidates: int = 16, sm_targets: tuple[int, ...] = (0,), x_transposed: bool = False,
                 w_transposed: bool = True, accumulate: bool = False, variants: bool = False):  # fmt: skip
        lib = _lib()
        if lib is None:
            raise CublasLtError("cuBLASLt is not available (no CUDA device)")
        if dtype not in _DTYPES:
            raise CublasLtError(f"LtProduct supports bf16 and fp16, not {dtype}")
        self.shape, self.dtype, self.has_bias = (m, n, k), dtype, bias
        self.x_transposed, self.w_transposed, self.accumulate = x_transposed, w_transposed, accumulate
        self.device = torch.cuda.current_device() if device is None else device
        vp = ctypes.c_void_p
        self._desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        # Column-major view of a row-major product: D[N, M] = op(W) @ op(X), W's storage as cuBLAS's A.
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T if w_transposed else _OP_N))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_T if x_transposed else _OP_N))
        self._set(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT))
        dt = _DTYPES[dtype]
        self._a, self._b, self._d = vp(), vp(), vp()
        a_rows, a_cols = (k, n) if w_transposed else (n, k)
        b_rows, b_cols = (m, k) if x_transposed else (k, m)
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), dt, a_rows, a_cols, a_rows), "MatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), dt, b_rows, b_cols, b_rows), "MatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), dt, n, m, n), "MatrixLayoutCreate")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8), "PreferenceSetAttribute")
        if bias:  # the heuristic may look at the epilogue's pointer alignment
            self._bias_probe = torch.zeros(n, dtype=dtype, device=f"cuda:{self.device}")
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(self._bias_probe.data_ptr()))
        # Asking the heuristic to plan for fewer SMs than the device has gives other tile shapes (it
        # sizes waves for that count); each answer runs with the target it was asked with.
        self.candidates, seen = [], set()
        for target in sm_targets:
            self._set(_DESC_SM_COUNT_TARGET, ctypes.c_int32(target))
            results = (_Heuristic * max_candidates)()
            count = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(self.device), self._desc, self._a, self._b, self._d, self._d, pref,
                                                      max_candidates, results, ctypes.byref(count)), "MatmulAlgoGetHeuristic")  # fmt: skip
            for i in range(count.value):
                r = results[i]
                key = (target, bytes(r.algo))
                if r.state != 0 or r.workspace_size > WORKSPACE_BYTES or key in seen:
                    continue
                seen.add(key)
                self.candidates.append(Candidate(i, target, r.algo, int(r.workspace_size), float(r.waves), _config(r.algo)))
            if variants:
                for base in [c for c in self.candidates if c.sm_target == target and not c.variant]:
                    for cand in self._variants(base):
                        key = (target, bytes(cand.algo))
                        if key not in seen:
                            seen.add(key)
                            self.candidates.append(cand)
        self._sm_target = sm_targets[-1]
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if not self.candidates:
            raise CublasLtError(f"cuBLASLt has no algorithm for {m} x {n} x {k} {dtype}")
        self.algo, self._workspace, self._ready = self.candidates[0], None, False  # workspace sized at first use
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)

    def __del__(self):
        try:
            lib = _lib()
            for layout in (getattr(self, "_a", None), getattr(self, "_b", None), getattr(self, "_d", None)):
                if layout:
                    lib.cublasLtMatrixLayoutDestroy(layout)
            if getattr(self, "_desc", None):
                lib.cublasLtMatmulDescDestroy(self._desc)
        except Exception:  # interpreter shutdown: the library or this module may be gone already
            pass

    def _variants(self, base: Candidate) -> list[Candidate]:
        """`base`'s kernel with each other split-K count, reduction scheme and swizzle it supports
        that cuBLASLt accepts for this product (the heuristic's SM target still set on the descriptor)."""
        lib = _lib()
        cap = functools.partial(_algo_attribute, lib.cublasLtMatmulAlgoCapGetAttribute, base.algo)
        split_ok, reductions, swizzle_ok = (cap(a) or 0 for a in (_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_MASK, _CAP_SWIZZLE_SUPPORT))
        splits = VARIANT_SPLITS if split_ok else (base.config.get("splitk", 1),)
        schemes = [r for r in _REDUCTION_NAMES if reductions & r]
        out = []
        for split in splits:
            for red in (schemes if split > 1 else [0]):
                for swizzle in ((0, 1) if swizzle_ok else (base.config.get("swizzle", 0),)):
                    settings = {"splitk": split, "reduction": red, "swizzle": swizzle}
                    if all(base.config.get(name, 0 if name != "splitk" else 1) == v for name, v in settings.items()):
                        continue  # the heuristic's own configuration
                    algo = _Algo.from_buffer_copy(base.algo)
                    for attr, v in ((_CONFIG_SPLITK, split), (_CONFIG_REDUCTION, red), (_CONFIG_SWIZZLE, swizzle)):
                        val = ctypes.c_uint32(v)
                        if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(val), 4) != 0:
                            break
                    else:
                        check = _Heuristic()
                        if lib.cublasLtMatmulAlgoCheck(_handle(self.device), self._desc, self._a, self._b, self._d, self._d,
                                                       ctypes.byref(algo), ctypes.byref(check)) != 0:  # fmt: skip
                            continue
                        if check.workspace_size > WORKSPACE_BYTES:
                            continue
                        label = f"splitK {split}" + (f" {_REDUCTION_NAMES[red]}" if red else "") + f" swizzle {swizzle}"
                        out.append(Candidate(base.index, base.sm_target, algo, int(check.workspace_size), float(check.waves),
                                             _config(algo), variant=label))  # fmt: skip
        return out

    def reference(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The product in fp32 by PyTorch, for checking a candidate."""
        a = x.float().t() if self.x_transposed else x.float()
        b = w.float().t() if self.w_transposed else w.float()
        return a @ b + (0 if bias is None else bias.float())

    def use(self, candidate: Candidate) -> None:
        """Runs `candidate` from now on (with a workspace of its own size)."""
        self.algo = candidate
        self._workspace = _workspace(self.device, candidate.workspace)
        self._ready = True

    def _set(self, attr: int, value) -> None:
        _check(_lib().cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "MatmulDescSetAttribute")

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 candidate: Candidate | None = None) -> torch.Tensor:  # fmt: skip
        m, n, k = self.shape
        x_shape, w_shape = ((k, m) if self.x_transposed else (m, k)), ((n, k) if self.w_transposed else (k, n))
        if x.shape != x_shape or w.shape != w_shape or x.dtype != self.dtype or w.dtype != self.dtype:
            raise CublasLtError(f"LtProduct({m}, {n}, {k}, {self.dtype}) called with x {tuple(x.shape)} {x.dtype}, "
                                f"w {tuple(w.shape)} {w.dtype}")  # fmt: skip
        if not (x.is_contiguous() and w.is_contiguous()):
            raise CublasLtError("LtProduct needs contiguous x and w")
        if (bias is not None) != self.has_bias:
            raise CublasLtError(f"LtProduct built with bias={self.has_bias}, called with bias={'given' if bias is not None else None}")
        if out is None:
            if self.accumulate:
                raise CublasLtError("an accumulating LtProduct adds to `out`: give it")
            out = torch.empty(m, n, dtype=self.dtype, device=x.device)
        elif out.shape != (m, n) or out.dtype != self.dtype or not out.is_contiguous():
            raise CublasLtError(f"LtProduct({m}, {n}, {k}) needs a contiguous {self.dtype} out of shape {(m, n)}, got "
                                f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        if candidate is None and not self._ready:
            self.use(self.algo)
        algo = candidate or self.algo
        workspace = self._workspace if candidate is None else _scratch_workspace(self.device)
        if algo.sm_target != self._sm_target:
            self._set(_DESC_SM_COUNT_TARGET, ctypes.c_int32(algo.sm_target))
            self._sm_target = algo.sm_target
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(_lib().cublasLtMatmul(
            _handle(self.device), self._desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), self._a,
            ctypes.c_void_p(x.data_ptr()), self._b, ctypes.byref(self._beta), ctypes.c_void_p(out.data_ptr()), self._d,
            ctypes.c_void_p(out.data_ptr()), self._d, ctypes.byref(algo.algo),
            ctypes.c_void_p(0 if workspace is None else workspace.data_ptr()), 0 if workspace is None else workspace.numel(),
            ctypes.c_void_p(stream),
        ), "cublasLtMatmul")  # fmt: skip
        return out


def _algo_attribute(getter, algo: _Algo, attr: int, ctype=ctypes.c_uint32) -> int | None:
    """One attribute of `algo` through `getter` (cublasLtMatmulAlgoConfigGetAttribute or
    ...CapGetAttribute), or None where cuBLASLt does not answer it."""
    v, written = ctype(0), ctypes.c_size_t(0)
    ok = getter(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written)) == 0
    return v.value if ok else None


def _config(algo: _Algo) -> dict:
    getter = _lib().cublasLtMatmulAlgoConfigGetAttribute
    values = {name: _algo_attribute(getter, algo, attr, ctypes.c_uint16 if attr in _CONFIG_U16 else ctypes.c_uint32)
              for name, attr in _CONFIG_ATTRS.items()}  # fmt: skip
    return {name: v for name, v in values.items() if v is not None}


def time_graph_us(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per call of `fn` (which makes `calls` products) replayed in one CUDA graph, best of `reps`."""
    s = _timing_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best * 1e3 / calls


# A candidate's largest difference from the fp32 product, relative to the output's scale, above which
# it is dropped (split-K sums in another order differ by a few bf16 ulps, ~4e-3).
CANDIDATE_TOLERANCE = 2e-2


def choose(product: LtProduct, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
           timer=None) -> list[tuple[Candidate, float]]:  # fmt: skip
    """Times every candidate whose output matches PyTorch's product over `weights` (each layer's
    own, as the engine multiplies them); returns (candidate, microseconds per product) sorted
    fastest first. A candidate further than CANDIDATE_TOLERANCE from the product is dropped: all of
    them must compute the same product. `timer(fn, calls)` gives microseconds per product of `fn`
    (which makes `calls` of them): `time_graph_us` by default. The caller `use`s what it keeps.

    The fp32 reference product runs on the default stream: PyTorch gives every stream its products
    run on a cuBLAS workspace of its own (32 MiB on Hopper) and keeps it, and the default stream's
    is there for training anyway."""
    current, default = torch.cuda.current_stream(), torch.cuda.default_stream()
    default.wait_stream(current)
    with torch.cuda.stream(default):
        ref = product.reference(x, weights[0], None if biases is None else biases[0])
    current.wait_stream(default)
    scale = ref.abs().max().item() + 1e-6
    out = torch.zeros(product.shape[0], product.shape[1], dtype=product.dtype, device=x.device)
    timed = []
    for cand in product.candidates:
        if product.accumulate:
            out.zero_()  # checked as a product: out = 0 + x @ w.T
        try:
            got = product(x, weights[0], None if biases is None else biases[0], out=out, candidate=cand).float()
        except CublasLtError:
            continue
        err = (got - ref).abs().max().item() / scale
        if err > CANDIDATE_TOLERANCE:
            continue

        def fn(cand=cand):
            for i, w in enumerate(weights):
                product(x, w, None if biases is None else biases[i], out=out, candidate=cand)

        timed.append((cand, (timer or time_graph_us)(fn, len(weights))))
    if not timed:
        raise CublasLtError(f"no cuBLASLt candidate reproduced the product {product.shape}")
    timed.sort(key=lambda t: t[1])
    return timed


def _saved_candidate(product: LtProduct, saved: dict) -> Candidate | None:
    """The candidate a saved choice names, if this cuBLASLt still offers it."""
    return next((c for c in product.candidates if c.sm_target == saved["choice"]["sm_target"]
                 and list(c.algo.data) == saved["choice"]["algo"]), None)  # fmt: skip


def _settle(key: tuple, product: LtProduct, best: Candidate, best_us: float, torch_us: float, min_gain: float,
            path: str | None, file_key: str) -> dict:  # fmt: skip
    """Keeps `best` for `key` where it beats PyTorch's product by `min_gain`, saves the decision, and
    returns the report of it."""
    keep = best_us < torch_us * (1.0 - min_gain)
    if keep:
        product.use(best)
        _CHOICES[key] = product
    choice = {"sm_target": best.sm_target, "algo": list(best.algo.data), "describe": best.describe()} if keep else None
    _save_cache(path, file_key, {"torch_us": torch_us, "best_us": best_us, "choice": choice})
    return {"torch_us": torch_us, "best_us": best_us, "choice": best.describe() if keep else "PyTorch's"}


# SM counts the heuristic is also asked to plan for (besides the device's own): on an H200 (132 SMs)
# these gave the decode step's fastest products (bench/decode_gemm.py --lt, rollout/native/NOTES.md).
DEFAULT_SM_TARGETS = (0,)


class TunedProducts:
    """The decode step's products, one choice per shape: the cuBLASLt candidate that ran fastest
    over the layers' own weights (`tune`), or PyTorch's product where none beat it by `min_gain`
    or cuBLASLt is missing. `linear` is F.linear's signature.

    Choices are process-wide (every engine in a process multiplies a shape the same way: graphed
    and eager steps agree) and saved to `cache_path` (default ~/.cache/hybridrl/cublaslt.json, keyed
    by GPU, cuBLASLt version and shape; HYBRIDRL_CUBLASLT_CACHE=off disables it), so a resumed run on
    the same machine multiplies as the first one did instead of timing again.
    """

    def __init__(self, *, sm_targets: tuple[int, ...] = DEFAULT_SM_TARGETS, max_candidates: int = 16,
                 min_gain: float = 0.01, cache_path: str | None = None, variants: bool = False):  # fmt: skip
        self.sm_targets, self.max_candidates, self.min_gain = sm_targets, max_candidates, min_gain
        # also time each answer's split-K / reduction / swizzle variants (LtProduct(variants=True)): measured
        # on W0.5B's decode products, none beat the heuristic's own answers (rollout/native/NOTES.md, session 26)
        self.variants = variants
        self.cache_path = _cache_path() if cache_path is None else cache_path
        self.report: dict[tuple, dict] = {}  # key -> {"torch_us", "best_us", "choice"}: what tune measured or loaded

    def _key(self, rows: int, w: torch.Tensor, bias: bool) -> tuple:
        return (rows, w.shape[0], w.shape[1], bias, w.dtype, w.device.index, self.sm_targets, self.variants)

    def tune(self, rows: int, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        """Chooses for products of `rows` rows by `weights` (all one shape; each layer's own)."""
        key = self._key(rows, weights[0], biases is not None)
        if key in _CHOICES:
            return
        _CHOICES[key] = None
        if not available() or weights[0].dtype not in _DTYPES or torch.cuda.is_current_stream_capturing():
            return
        n, k = weights[0].shape
        try:
            product = LtProduct(rows, n, k, weights[0].dtype, bias=biases is not None, max_candidates=self.max_candidates,
                                sm_targets=self.sm_targets, variants=self.variants)  # fmt: skip
        except CublasLtError as e:
            self.report[key] = {"error": str(e)}
            return
        file_key = _file_key(key)
        saved = _load_cache(self.cache_path).get(file_key)
        if saved is not None:
            if saved["choice"] is None:
                self.report[key] = {**saved, "choice": "PyTorch's (saved)"}
                return
            match = _saved_candidate(product, saved)
            if match is not None:
                product.use(match)
                _CHOICES[key] = product
                self.report[key] = {**saved, "choice": match.describe() + " (saved)"}
                return
        x = torch.randn(rows, k, dtype=weights[0].dtype, device=weights[0].device)
        # PyTorch's pick is cuBLASLt's first answer for the device's SM count (candidate #0), so its
        # time is #0's: timing F.linear itself on the tuning stream would leave that stream a cuBLAS
        # workspace of PyTorch's (32 MiB, kept for the process: W0.5B's training peak was 0.034 GiB
        # higher in the process that tuned than in one that loaded the choices).
        stream = _timing_stream()
        stream.wait_stream(torch.cuda.current_stream())  # x and the weights are ready
        with torch.cuda.stream(stream):
            try:
                timed = choose(product, x, weights, biases)
            except CublasLtError as e:
                self.report[key] = {"error": str(e)}
                stream.synchronize()
                release_scratch()
                return
        torch.cuda.current_stream().wait_stream(stream)
        stream.synchronize()
        release_scratch()
        best, best_us = timed[0]
        torch_us = next((us for c, us in timed if c.is_pytorch_pick), None)
        if torch_us is None:  # PyTorch's pick was not among the timed: never keep what was not compared with it
            self.report[key] = {"best_us": best_us, "choice": "PyTorch's (not timed)"}
            return
        self.report[key] = _settle(key, product, best, best_us, torch_us, self.min_gain, self.cache_path, file_key)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        product = _CHOICES.get(self._key(x.shape[0], w, b is not None)) if x.dim() == 2 else None
        if product is None or not (x.is_contiguous() and w.is_contiguous()) or x.dtype != w.dtype:
            return torch.nn.functional.linear(x, w, b)
        return product(x, w, b)


_CHOICES: dict[tuple, LtProduct | None] = {}  # process-wide: TunedProducts' / tune_product's choice per shape


def time_eager_us(fn, reps: int = 10, rounds: int = 3) -> float:
    """Microseconds per call of `fn` launched `reps` times back to back on the current stream, best
    of `rounds`: for products long enough (~100 us and up) that launching them costs nothing."""
    fn()
    fn()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best * 1e3


def _product_key(m: int, n: int, k: int, dtype: torch.dtype, device: int, x_transposed: bool, w_transposed: bool,
                 accumulate: bool, variants: bool) -> tuple:  # fmt: skip
    return ("product", m, n, k, dtype, device, x_transposed, w_transposed, accumulate, variants)


def tuned_product(m: int, n: int, k: int, dtype: torch.dtype, *, x_transposed: bool = False, w_transposed: bool = True,
                  accumulate: bool = False, device: int | None = None, variants: bool = False) -> LtProduct | None:  # fmt: skip
    """The product `tune_product` chose for this shape and layout, or None (not tuned, or PyTorch's
    product was as fast): the caller then multiplies with PyTorch."""
    dev = torch.cuda.current_device() if device is None else device
    return _CHOICES.get(_product_key(m, n, k, dtype, dev, x_transposed, w_transposed, accumulate, variants))


def tune_product(m: int, n: int, k: int, dtype: torch.dtype, *, x_transposed: bool = False, w_transposed: bool = True,
                 accumulate: bool = False, min_gain: float = 0.01, max_candidates: int = 16,
                 cache_path: str | None = "default", variants: bool = False) -> dict:  # fmt: skip
    """Chooses, once per process, how to run one product of a fixed shape and layout (LtProduct's
    arguments): each of cuBLASLt's candidates and PyTorch's own product (`torch.mm` / `addmm_` of
    the same layout) are timed on the current stream with random operands, and the fastest
    candidate is kept where it beats PyTorch's by `min_gain`. Returns what was measured or loaded
    (also for a shape chosen before). The operands, an output and a 32 MiB timing workspace are
    allocated meanwhile and freed after, so call it where memory is free (before training starts).
    Choices are saved with TunedProducts' (`cache_path` "default": its file)."""
    dev = torch.cuda.current_device()
    key = _product_key(m, n, k, dtype, dev, x_transposed, w_transposed, accumulate, variants)
    if key in _REPORTS:
        return _REPORTS[key]
    _CHOICES[key] = None
    report = _REPORTS[key] = {}
    if not available() or dtype not in _DTYPES or torch.cuda.is_current_stream_capturing():
        report["choice"] = "PyTorch's (cuBLASLt unavailable)"
        return report
    path = _cache_path() if cache_path == "default" else cache_path
    layout = f"{'xT' if x_transposed else 'x'},{'wT' if w_transposed else 'w'}{',acc' if accumulate else ''}"
    version = _lib().cublasLtGetVersion()
    file_key = (f"{torch.cuda.get_device_name(dev)}|cublasLt {version}|{m}x{n}x{k}|layout={layout}|{str(dtype).removeprefix('torch.')}"
                + ("|variants" if variants else ""))
    try:
        product = LtProduct(m, n, k, dtype, bias=False, max_candidates=max_candidates, x_transposed=x_transposed,
                            w_transposed=w_transposed, accumulate=accumulate, variants=variants)  # fmt: skip
    except CublasLtError as e:
        report["error"] = str(e)
        return report
    saved = _load_cache(path).get(file_key)
    if saved is not None:
        match = None if saved["choice"] is None else _saved_candidate(product, saved)
        if saved["choice"] is None or match is not None:
            if match is not None:
                product.use(match)
                _CHOICES[key] = product
            report.update(saved, choice=(match.describe() if match is not None else "PyTorch's") + " (saved)")
            return report
    x = torch.randn(*((k, m) if x_transposed else (m, k)), dtype=dtype, device=f"cuda:{dev}")
    w = torch.randn(*((n, k) if w_transposed else (k, n)), dtype=dtype, device=f"cuda:{dev}") * k**-0.5
    out = torch.zeros(m, n, dtype=dtype, device=f"cuda:{dev}")
    a, b = (x.t() if x_transposed else x), (w.t() if w_transposed else w)
    torch_us = time_eager_us((lambda: out.addmm_(a, b)) if accumulate else (lambda: torch.mm(a, b, out=out)))
    del out
    try:
        timed = choose(product, x, [w], timer=lambda fn, calls: time_eager_us(fn) / calls)
    except CublasLtError as e:
        report.update(torch_us=torch_us, error=str(e))
        return report
    finally:
        release_scratch()
    report.update(_settle(key, product, *timed[0], torch_us, min_gain, path, file_key))
    return report


_REPORTS: dict[tuple, dict] = {}  # tune_product's report per key (what it measured or loaded)


def _cache_path() -> str | None:
    env = os.environ.get("HYBRIDRL_CUBLASLT_CACHE")
    if env is not None:
        return None if env.lower() in ("", "0", "off", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridrl", "cublaslt.json")


def _file_key(key: tuple) -> str:
    rows, n, k, bias, dtype, device, targets, variants = key
    version = _lib().cublasLtGetVersion() if _lib() is not None else 0
    name = torch.cuda.get_device_name(device)
    return (f"{name}|cublasLt {version}|{rows}x{n}x{k}|bias={int(bias)}|{str(dtype).removeprefix('torch.')}"
            f"|sm_targets={','.join(map(str, targets))}" + ("|variants" if variants else ""))


def _load_cache(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # unreadable: time again (and rewrite it)


def _save_cache(path: str | None, key: str, entry: dict) -> None:
    """Adds one entry, written atomically (another process may be reading or writing it too)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        data = _load_cache(path)
        data[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process


_timing_streams: dict[int, torch.cuda.Stream] = {}


def _timing_stream() -> torch.cuda.Stream:
    """The stream tuning runs on: the caller's when it is a side stream (the engine tunes on the
    stream its decode graphs are captured on), else one kept for tuning. A graph cannot be captured
    on the default stream, and every stream PyTorch's products run on holds a cuBLAS workspace of
    its own (32 MiB on Hopper) until the workspaces are cleared, so no stream is made per call."""
    current = torch.cuda.current_stream()
    if current != torch.cuda.default_stream():
        return current
    dev = torch.cuda.current_device()
    if dev not in _timing_streams:
        _timing_streams[dev] = torch.cuda.Stream()
    return _timing_streams[dev]
