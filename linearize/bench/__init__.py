"""Benchmarks: latency and memory of teacher vs converted models, measured as ratios in one run."""
