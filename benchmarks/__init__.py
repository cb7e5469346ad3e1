"""Research instruments: measurements made while building veloxquant, kept to re-run them.

Not part of the installed package (the wheel ships `veloxquant/` only). Run one from the repository
root with `python -m benchmarks.NAME --help`. They use veloxquant's public functions only (a test
checks that none reaches a private name of a veloxquant module). The benches a user runs are
`veloxquant bench NAME` (`veloxquant bench --list`).
"""
