"""Spherical K-means under the cosine objective: Hungarian-balanced (ELDR's offline
clustering, one centroid per decoder) and plain (the ablation).

Points are rows of x [N, D], scaled to unit length on entry (an all-zero row stays zero
and is at cosine distance 1 from every centroid). The objective is the total cosine
distance Σ_i (1 − x_i · c_{a(i)}) of the points to their centroids.

* Initialization: k-means++ under cosine distance, drawn with
  ``np.random.default_rng(seed)``: the first centroid is a point drawn uniformly, each
  next one a point drawn with probability ∝ d², d its cosine distance to the nearest
  centroid so far (uniformly among the points not yet drawn when every d is 0).
* Assignment: balanced — ``scipy.optimize.linear_sum_assignment`` on the cost matrix
  [N, K·cap], cap = ⌈N/K⌉, whose columns are each centroid's cost 1 − cos repeated cap
  times, so every centroid takes at most cap points and the total cosine distance is the
  least such an assignment allows; plain — each point to its most similar centroid
  (ties: the lower index), no capacity.
* Update: each centroid is the normalized mean of its points. A cluster left empty
  (plain mode; in balanced mode too when (K − 1)·cap >= N, e.g. N = 5, K = 4) is
  re-seeded with the point farthest from its own centroid, taken from a cluster of two
  or more points (the capacity still holds: the re-seeded cluster has one point).
* Stop when an assignment step changes no point's cluster (``converged``), or after
  ``max_iterations`` assignment steps. ``iterations`` counts the assignment steps run.
  (With fewer distinct points than clusters a re-seeded duplicate can lose its point
  again at every step: such a run ends unconverged at ``max_iterations``.)

The balanced assignment solves an assignment problem of N × K·cap (about N²) each
iteration: fine for calibration sets of hundreds to a few thousand requests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import scipy.optimize
from jaxtyping import Float

from moejax.eldr.signature import normalize

DEFAULT_MAX_ITERATIONS = 50


@dataclasses.dataclass(frozen=True, eq=False)
class KMeansResult:
    """One clustering: ``centroids`` [K, D] unit rows (a cluster of zero vectors only
    keeps a zero centroid), ``assignment`` [N] the cluster of each point, the assignment
    steps run, the total cosine distance, and whether the assignment settled."""

    centroids: np.ndarray
    assignment: np.ndarray
    iterations: int
    objective: float
    converged: bool

    @property
    def sizes(self) -> np.ndarray:
        """Points per cluster [K]."""
        return np.bincount(self.assignment, minlength=len(self.centroids))


def capacity(num_points: int, k: int) -> int:
    """cap = ⌈N/K⌉, the most points a balanced centroid takes."""
    return -(-num_points // k)


def balanced_kmeans(x: Float[np.ndarray, "N D"], k: int, *, seed: int = 0,
                    max_iterations: int = DEFAULT_MAX_ITERATIONS) -> KMeansResult:
    """Hungarian-balanced spherical K-means: every centroid takes at most ⌈N/K⌉ points
    (module docstring: initialization, assignment, update, stopping)."""
    return _kmeans(x, k, seed, max_iterations, _balanced_assignment)


def plain_kmeans(x: Float[np.ndarray, "N D"], k: int, *, seed: int = 0,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS) -> KMeansResult:
    """Plain spherical K-means (the ablation): each point to its most similar centroid,
    no capacity; otherwise as :func:`balanced_kmeans`."""
    return _kmeans(x, k, seed, max_iterations, _nearest_assignment)


KMEANS: dict[str, Callable[..., KMeansResult]] = {"balanced": balanced_kmeans,
                                                  "plain": plain_kmeans}
"""The clusterings by name (``EldrFit.clustering``)."""


# ----------------------------------------------------------------------------- steps
def _balanced_assignment(similarity: np.ndarray) -> np.ndarray:
    num_points, k = similarity.shape
    cap = capacity(num_points, k)
    cost = np.repeat(1.0 - similarity, cap, axis=1)    # [N, K·cap]: column j -> centroid j // cap
    rows, cols = scipy.optimize.linear_sum_assignment(cost)
    assignment = np.empty(num_points, np.int64)
    assignment[rows] = cols // cap
    return assignment


def _nearest_assignment(similarity: np.ndarray) -> np.ndarray:
    return np.argmax(similarity, axis=1).astype(np.int64)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding under cosine distance (module docstring)."""
    num_points = len(x)
    chosen = [int(rng.integers(num_points))]
    nearest = np.clip(1.0 - x @ x[chosen[0]], 0.0, None)
    for _ in range(1, k):
        weights = nearest ** 2
        weights[chosen] = 0.0
        total = weights.sum()
        if total > 0:
            index = int(rng.choice(num_points, p=weights / total))
        else:                                   # every point sits on a centroid already
            free = np.setdiff1d(np.arange(num_points), chosen)
            index = int(free[rng.integers(len(free))])
        chosen.append(index)
        nearest = np.minimum(nearest, np.clip(1.0 - x @ x[index], 0.0, None))
    return x[chosen].copy()


def _update(x: np.ndarray, assignment: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """New centroids (normalized means) and the assignment after re-seeding empty
    clusters (module docstring)."""
    assignment = assignment.copy()
    sums = np.zeros((k, x.shape[1]))
    np.add.at(sums, assignment, x)
    centroids = normalize(sums)
    sizes = np.bincount(assignment, minlength=k)
    for empty in np.flatnonzero(sizes == 0):
        distance = 1.0 - np.einsum("nd,nd->n", x, centroids[assignment])
        distance[sizes[assignment] < 2] = -np.inf     # never empty another cluster
        point = int(np.argmax(distance))
        donor = int(assignment[point])
        assignment[point] = empty
        sizes[donor] -= 1
        sizes[empty] += 1
        centroids[empty] = x[point]
        centroids[donor] = normalize(x[assignment == donor].sum(axis=0))
    return centroids, assignment


def _kmeans(x: Any, k: Any, seed: Any, max_iterations: Any,
            assign: Callable[[np.ndarray], np.ndarray]) -> KMeansResult:
    x, k = _check_inputs(x, k, seed, max_iterations)
    rng = np.random.default_rng(seed)
    centroids = _kmeans_pp(x, k, rng)
    assignment: np.ndarray | None = None
    converged, iterations = False, 0
    while iterations < max_iterations:
        iterations += 1
        new = assign(x @ centroids.T)
        if assignment is not None and np.array_equal(new, assignment):
            converged = True
            break
        centroids, assignment = _update(x, new, k)
    assert assignment is not None
    distance = 1.0 - np.einsum("nd,nd->n", x, centroids[assignment])
    objective = float(np.clip(distance, 0.0, 2.0).sum())
    return KMeansResult(centroids=centroids, assignment=assignment, iterations=iterations,
                        objective=objective, converged=converged)


def _check_inputs(x: Any, k: Any, seed: Any, max_iterations: Any) -> tuple[np.ndarray, int]:
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x must be points [N >= 1, D >= 1], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x holds a NaN or an infinity")
    for name, value, low in (("k", k, 1), ("seed", seed, 0), ("max_iterations", max_iterations, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if k > x.shape[0]:
        raise ValueError(f"k = {k} clusters for N = {x.shape[0]} points: K-means needs "
                         f"1 <= k <= N")
    return normalize(x), int(k)

