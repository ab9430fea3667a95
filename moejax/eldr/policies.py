"""Decode routing policies: which of K decoders takes a request at the prefill→decode
hand-off. The runtime (``moejax.core.decoders``) and the simulator
(:mod:`moejax.eldr.simulator`) both call these same objects, so a simulated figure is
the routing the runtime would do.

A policy sees the request's :class:`HandOff` (its raw prompt expert counts, summed from
the signature cache, and its domain label when it has one) and the decoders' loads —
in-flight decode requests, running or queued — and returns a decoder index.

* ``random`` — uniform; ``round_robin`` — in turn;
* ``jsq`` — join the shortest queue (the fewest in flight; ties: the lowest index);
* ``p2c`` — power of two choices: two distinct decoders drawn at random, the less
  loaded (ties: the first drawn);
* ``domain`` — the label oracle: domain i of D owns decoders {j : j mod D = i} (when
  K >= D; else decoder i mod K), and the request joins the least loaded of its domain's;
  the domains are given, or numbered in the order they are first seen (then D is the
  number seen so far: a domain's decoders narrow as new domains arrive);
* ``eldr`` — the locality band: s* = the best cosine similarity of the request's
  signature to the K centroids; among decoders with similarity >= s* - τ, the fewest
  in flight (ties: the lowest index). Signatures and centroids are non-negative unit
  vectors, so similarities lie in [0, 1]: τ = 1 admits every decoder and is exactly
  ``jsq``; τ = 0 is pure locality.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import dataclasses

import numpy as np

from moejax.eldr.fitfile import EldrFit

POLICIES = ("random", "round_robin", "jsq", "p2c", "domain", "eldr")
DEFAULT_TAU = 0.1
# Similarities are exact in [0, 1] only up to rounding: the band's edge is widened by
# this much so that τ = 1 admits every decoder whatever the rounding.
_BAND_SLACK = 1e-9


@dataclasses.dataclass(frozen=True)
class HandOff:
    """What a router sees of one request: ``counts`` [L, E], its prompt tokens' top-k
    counts per layer and expert (ELDR's raw signature; None where unknown), and its
    ``domain`` label (the oracle's; None where unknown)."""

    counts: np.ndarray | None = None
    domain: str | None = None


class Policy(abc.ABC):
    """Chooses a decoder for each request (module docstring). ``reads_counts``: whether
    it reads the hand-off's prompt expert counts (the runtime then keeps the signature
    cache)."""

    name = ""
    reads_counts = False

    def __init__(self, num_decoders: int):
        if isinstance(num_decoders, bool) or not isinstance(num_decoders, int) \
                or num_decoders < 1:
            raise ValueError(f"the number of decoders must be a positive integer, got "
                             f"{num_decoders!r}")
        self.num_decoders = num_decoders

    def choose(self, request: HandOff, loads: Sequence[int]) -> int:
        """The decoder for ``request``, given each decoder's in-flight requests."""
        if len(loads) != self.num_decoders:
            raise ValueError(f"{len(loads)} loads for {self.num_decoders} decoders")
        return self._choose(request, np.asarray(loads))

    @abc.abstractmethod
    def _choose(self, request: HandOff, loads: np.ndarray) -> int: ...


def least_loaded(loads: np.ndarray, candidates: np.ndarray | None = None) -> int:
    """The candidate with the fewest in flight (ties: the lowest index); every decoder
    when ``candidates`` is None."""
    if candidates is None:
        return int(np.argmin(loads))
    return int(candidates[np.argmin(loads[candidates])])


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, num_decoders: int, seed: int = 0):
        super().__init__(num_decoders)
        self._rng = np.random.default_rng(seed)

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        return int(self._rng.integers(self.num_decoders))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, num_decoders: int):
        super().__init__(num_decoders)
        self._next = 0

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        chosen, self._next = self._next, (self._next + 1) % self.num_decoders
        return chosen


class JSQPolicy(Policy):
    name = "jsq"

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        return least_loaded(loads)


class P2CPolicy(Policy):
    name = "p2c"

    def __init__(self, num_decoders: int, seed: int = 0):
        super().__init__(num_decoders)
        self._rng = np.random.default_rng(seed)

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        if self.num_decoders == 1:
            return 0
        first, second = (int(i) for i in self._rng.choice(self.num_decoders, 2, replace=False))
        return second if loads[second] < loads[first] else first


class DomainPolicy(Policy):
    """The domain-label oracle (module docstring); a request with no known domain joins
    the shortest queue."""

    name = "domain"

    def __init__(self, num_decoders: int, domains: Sequence[str] | None = None):
        super().__init__(num_decoders)
        if domains is not None and (not domains or len(set(domains)) != len(domains)):
            raise ValueError(f"the domain oracle needs distinct domain labels, got "
                             f"{list(domains)!r}")
        self.fixed = domains is not None
        self.domains: list[str] = list(domains or [])

    def decoders_of(self, domain: str) -> np.ndarray:
        """The decoders that domain ``domain`` (a known one) owns."""
        index, count, k = self.domains.index(domain), len(self.domains), self.num_decoders
        return np.array([index % k]) if k < count else np.arange(index, k, count)

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        domain = request.domain
        if domain is None or (self.fixed and domain not in self.domains):
            return least_loaded(loads)
        if domain not in self.domains:
            self.domains.append(domain)
        return least_loaded(loads, self.decoders_of(domain))


class EldrPolicy(Policy):
    """The locality band over a fit's centroids (module docstring)."""

    name = "eldr"
    reads_counts = True

    def __init__(self, fit: EldrFit, tau: float = DEFAULT_TAU):
        super().__init__(fit.num_decoders)
        self.fit = fit
        self.tau = check_tau(tau)

    def similarities(self, counts: np.ndarray) -> np.ndarray:
        """Cosine similarity of the request's signature to each centroid [K]."""
        return self.fit.centroids @ self.fit.signature(counts)

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        if request.counts is None:
            raise ValueError("ELDR routing needs the request's prompt expert counts")
        sims = self.similarities(request.counts)
        band = np.flatnonzero(sims >= sims.max() - self.tau - _BAND_SLACK)
        return least_loaded(loads, band)


def check_tau(tau: Any) -> float:
    """τ as a float in [0, 1], or a ValueError naming it."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) \
            or not 0 <= tau <= 1:
        raise ValueError(f"eldr_tau must be a number in [0, 1] (0: pure locality, 1: "
                         f"join-shortest-queue), got {tau!r}")
    return float(tau)


def make_policy(name: str, num_decoders: int, *, fit: EldrFit | None = None,
                tau: float = DEFAULT_TAU, seed: int = 0,
                domains: Sequence[str] | None = None) -> Policy:
    """The policy ``name`` for ``num_decoders`` decoders (``fit`` for eldr, ``domains``
    for the oracle, ``seed`` for the random ones)."""
    if name not in POLICIES:
        raise ValueError(f"routing must be one of {POLICIES}, got {name!r}")
    if name == "eldr":
        if fit is None:
            raise ValueError("routing='eldr' needs a fit (eldr_fit=PATH, made by "
                             "`moejax eldr-fit TRACES -o PATH --decoders K`)")
        if fit.num_decoders != num_decoders:
            raise ValueError(f"the ELDR fit has {fit.num_decoders} centroids, but there are "
                             f"{num_decoders} decoders; refit with --decoders {num_decoders}")
        return EldrPolicy(fit, tau)
    check_tau(tau)
    if name == "random":
        return RandomPolicy(num_decoders, seed)
    if name == "round_robin":
        return RoundRobinPolicy(num_decoders)
    if name == "jsq":
        return JSQPolicy(num_decoders)
    if name == "p2c":
        return P2CPolicy(num_decoders, seed)
    return DomainPolicy(num_decoders, domains)
