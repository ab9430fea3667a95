"""moejax's benchmarks: each module is run as ``python -m benchmarks.NAME`` from the
repository root; what they share lives in :mod:`benchmarks.lib`."""
