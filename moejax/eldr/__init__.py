"""ELDR: expert-locality-aware routing of decode requests across data-parallel decoders
(``../shared/seeds/eldr-expert-locality-decode-routing.txt``).

* :mod:`~moejax.eldr.signature` — a request's expert signature from its prompt tokens'
  top-k counts (Count·IDF, a layer mask, L2 norm), the baselines (router softmax,
  binary), and the signature-quality statistic ρ with the greedy layer selection;
* :mod:`~moejax.eldr.kmeans` — Hungarian-balanced K-means (and plain K-means, the
  ablation) under the cosine objective;
* :mod:`~moejax.eldr.fitfile` — the fitted router (IDF, layers, centroids), versioned
  against the model it was fitted for, on disk;
* :mod:`~moejax.eldr.fitting` — the offline fit from an expert trace (``moejax eldr-fit``);
* :mod:`~moejax.eldr.policies` — every decode routing policy (Random, RR, JSQ, P2C, the
  domain oracle, ELDR's locality band): the one code the runtime
  (``moejax.core.decoders``) and the simulator (:mod:`~moejax.eldr.simulator`) both run.
"""
