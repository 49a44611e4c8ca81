"""GPU building blocks that both the rollout engine and the trainer use, and that know neither:
matrix products through cuBLASLt with timed algorithm choices (cublaslt.py)."""
