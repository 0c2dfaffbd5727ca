"""Pieces of the proxy benchmark (tests/bench/bench_proxy.py): an instant SGLang-shaped
backend, a raw HTTP load generator, process control and the report table."""
