"""Parts of benchmarks/decode_bench.py that run in its own process only: ``engines`` (--engines)."""
