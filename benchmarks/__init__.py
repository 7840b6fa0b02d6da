"""Benchmarks, soaks and peer runners: `python -m benchmarks.<name> --help`. Not part of the
runtime: nothing under sglang_like/ imports them. `common` holds what they share."""
