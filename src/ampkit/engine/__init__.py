"""How a training step runs: prepare, the prepared module, optimizer, scheduler and loader, the accumulation cycle,
micro-batching, clipping, compilation, events, data parallelism and launch-time settings."""
