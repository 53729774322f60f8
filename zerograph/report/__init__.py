"""What a step cost: ``zerograph.stats``, predicted and measured timelines, profiled per-node
compute time, and profiler traces read with Perfetto."""
