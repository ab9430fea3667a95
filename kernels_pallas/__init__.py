"""Pallas kernels of moejax, each beside its pure-JAX reference and its test.

The grouped GEMM's pure-JAX paths live in ``moejax.grouped_gemm``; the Pallas
kernels (grouped GEMM, METRO routing) are added here by the kernels work.
"""
