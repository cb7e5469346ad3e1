"""The benches behind `veloxquant bench NAME` (the registry: bench/registry.py; `veloxquant bench --list`)."""
