"""Host time to enqueue one cuBLAS product, under torch's deterministic mode and CUBLAS_WORKSPACE_CONFIG.

    python bench/cublas_host.py [--settings off,det,env,det+env] [--workspace :4096:8] [--calls 100]

Each setting runs in its own process (the variable is read by torch's CUDA code, so it must be in
the environment before the first product): `off` neither, `det` torch.use_deterministic_algorithms
(True) as `train.deterministic` sets it, `env` CUBLAS_WORKSPACE_CONFIG=--workspace, `det+env` both.
For W0.5B's training shapes (bf16) it enqueues `--calls` products after 20 warm-up calls and prints
microseconds per call: the host's (the loop without a sync) and the wall's (to the end of the last
product). Where the host's time is above the GPU's, a training phase whose GPU waits on its host
pays it for every product (train/NOTES.md, session 31: on torch 2.11 the variable took `mm` from
~15-25 to ~55-100 us of host time and `addmm` with a bias to ~130-200 us).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = ("off", "det", "env", "det+env")
SHAPES = ((13056, 896, 4864), (13056, 4864, 896))  # (tokens, in, out): W0.5B's gate|up and down products per micro-batch


def parse_settings(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        raise SystemExit(f"--settings {text!r}: choose from {', '.join(SETTINGS)} (comma-separated)")
    return names


def child(setting: str, calls: int) -> list[dict]:
    """Runs in the setting's own process; returns one row per (shape, op)."""
    import torch
    import torch.nn.functional as F
    import torch.utils.deterministic

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if "det" in setting:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # as train.deterministic leaves it
    rows = []
    for M, K, N in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ops = {"mm": lambda: torch.mm(a, w.t()), "linear+bias": lambda: F.linear(a, w, bias),
               "addmm": lambda: torch.addmm(bias, a, w.t()), "mm weight grad": lambda: torch.mm(g.t(), a)}  # fmt: skip
        for name, op in ops.items():
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rows.append({"setting": setting, "shape": f"{M}x{K}x{N}", "op": name,
                         "host_us": 1e6 * (t1 - t0) / calls, "wall_us": 1e6 * (t2 - t0) / calls})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """One line per (shape, op), one column per setting: host us (wall us)."""
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    keys = list(dict.fromkeys((r["shape"], r["op"]) for r in rows))
    cell = {(r["setting"], r["shape"], r["op"]): r for r in rows}
    lines = ["| product | " + " | ".join(f"{s}: host (wall) us" for s in settings) + " |", "| --- |" + " ---: |" * len(settings)]
    for shape, op in keys:
        vals = [cell.get((s, shape, op)) for s in settings]
        lines.append(f"| {op} {shape} | " + " | ".join(f"{v['host_us']:.1f} ({v['wall_us']:.1f})" if v else "-" for v in vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--workspace", default=":4096:8", help="CUBLAS_WORKSPACE_CONFIG for the env settings")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.calls)))
        return []
    rows = []
    for setting in parse_settings(args.settings):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if "env" in setting:
            env["CUBLAS_WORKSPACE_CONFIG"] = args.workspace
        out = subprocess.run([sys.executable, __file__, "--child", setting, "--calls", str(args.calls)], env=env,
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"setting {setting}: {(out.stderr or out.stdout).strip().splitlines()[-1]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
