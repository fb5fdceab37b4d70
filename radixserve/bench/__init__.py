"""Benchmarks: each prints figures next to a baseline measured in the same run."""
