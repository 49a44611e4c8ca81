#!/usr/bin/env bash
# The demo: GRPO on the tiny arithmetic model, on CPU; prints held-out accuracy before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hybridrl demo "$@"
