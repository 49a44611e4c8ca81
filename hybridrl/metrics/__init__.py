"""Step records: timers, memory, throughput, and the sinks they are written to."""

from hybridrl.metrics.progress import ConsoleProgress
from hybridrl.metrics.sinks import JsonlSink, MetricsWriteError, TensorBoardSink, read_records
from hybridrl.metrics.timing import CompileClock, GcClock, PhaseTimer, memory_metrics

__all__ = ["CompileClock", "ConsoleProgress", "GcClock", "JsonlSink", "MetricsWriteError", "PhaseTimer", "TensorBoardSink", "memory_metrics", "read_records"]
