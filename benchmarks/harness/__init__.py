"""Benchmarks: pagedkv beside its anchors in the same run (not tests)."""
