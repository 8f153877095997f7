"""Smoke runs of the benchmarks, so that a change that breaks one is seen."""
