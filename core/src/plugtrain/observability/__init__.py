"""Observability: step metrics and their sinks, hook tracing, plots of runs."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.observability.costs import CostCounter as CostCounter
    from plugtrain.observability.limits import MatmulLimit as MatmulLimit
    from plugtrain.observability.limits import matmul_seconds as matmul_seconds
    from plugtrain.observability.limits import peak_tflops as peak_tflops
    from plugtrain.observability.logs import setup_logging as setup_logging
    from plugtrain.observability.metrics import MetricsLogger as MetricsLogger
    from plugtrain.observability.metrics import to_number as to_number
    from plugtrain.observability.metrics import write_run_records as write_run_records
    from plugtrain.observability.plot import plot_runs as plot_runs
    from plugtrain.observability.timing import StepTimer as StepTimer
    from plugtrain.observability.timing import peak_memory_gib as peak_memory_gib
    from plugtrain.observability.timing import throughput as throughput
    from plugtrain.observability.trace import HookTracer as HookTracer
    from plugtrain.observability.trace import tracing_requested as tracing_requested
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
