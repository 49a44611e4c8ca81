#!/usr/bin/env bash
# The test suite (GPU tests skip themselves on CPU-only machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
