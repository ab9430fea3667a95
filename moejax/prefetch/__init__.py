"""Speculative expert prefetch for offloaded decode (issue 18)."""
