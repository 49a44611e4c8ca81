"""bench/cublas_host.py (host time per cuBLAS product by setting): its arguments, its table, and its
refusal on a machine without a GPU (the measurement itself needs one)."""

from __future__ import annotations

import pytest
import torch

from conftest import bench_script


def test_settings_are_checked_and_the_table_has_a_column_per_setting():
    cublas_host = bench_script("cublas_host")
    assert cublas_host.parse_settings("off, det+env") == ["off", "det+env"]
    for bad in ("", "fast", "off,envdet"):
        with pytest.raises(SystemExit, match="choose from off, det, env, det\\+env"):
            cublas_host.parse_settings(bad)
    rows = [{"setting": s, "shape": "8x4x2", "op": op, "host_us": h, "wall_us": w}
            for s, op, h, w in [("off", "mm", 15.04, 150.0), ("env", "mm", 66.1, 158.8), ("off", "addmm", 20.0, 160.0)]]  # fmt: skip
    lines = cublas_host.table(rows).splitlines()
    assert lines[0] == "| product | off: host (wall) us | env: host (wall) us |"
    assert lines[2] == "| mm 8x4x2 | 15.0 (150.0) | 66.1 (158.8) |"
    assert lines[3] == "| addmm 8x4x2 | 20.0 (160.0) | - |"  # a setting without that row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so():
    cublas_host = bench_script("cublas_host")
    with pytest.raises(SystemExit, match="setting off: needs a CUDA GPU"):
        cublas_host.main(["--settings", "off", "--calls", "1"])
