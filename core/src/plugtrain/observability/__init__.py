"""Observability: step metrics and their sinks, hook tracing, plots of runs."""
