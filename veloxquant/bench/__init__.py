"""Benchmarks behind `veloxquant bench ...` (attention: fused decode kernel vs alternatives)."""
