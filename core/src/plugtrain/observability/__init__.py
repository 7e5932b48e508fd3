"""Observability: step metrics and their sinks, hook tracing, plots of runs."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "costs": ["CostCounter"],
        "logs": ["setup_logging"],
        "metrics": ["MetricsLogger", "to_number", "write_run_records"],
        "plot": ["plot_runs"],
        "timing": ["StepTimer", "peak_memory_gib", "peak_tflops", "throughput"],
        "trace": ["HookTracer", "tracing_requested"],
    },
)
