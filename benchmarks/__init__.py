"""Benchmarks, one command each: ``python -m benchmarks NAME [options]``."""
