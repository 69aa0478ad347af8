"""Benchmarks of the shim against the legacy app and a direct Triton client: `python -m bench --help`."""
