"""Benchmarks: prefill and decode speed, memory."""
