"""A model of the whole prefill→decode pipeline at Qwen3-30B-A3B shape under H100 costs
(issue 44): a prefill stage (sync EP or AsyncEP) handing requests to K continuous-batching
decoders (JSQ or ELDR routing, EPLB-even or METRO token routing inside each decoder's
expert-parallel group, experts resident or offloaded with prefetch).

Modules, one job each:

* :mod:`moejax.pipeline_sim.shape` -- the lift of real (demo) expert traces to the model
  shape (:class:`moejax.model_shape.ModelShape`, Qwen3-30B-A3B's ``QWEN3_30B_A3B``);
* :mod:`moejax.pipeline_sim.hardware` -- the measured H100 expert-cost fit and the modelled
  EPLB replication (the H100 figures are ``moejax.asyncmoe.costs``' ``H100_*``);
* :mod:`moejax.pipeline_sim.prefill` -- the prefill stage: per-layer times, FCFS batches;
* :mod:`moejax.pipeline_sim.decode_cost` -- a decoder's step cost: EPLB-even or METRO
  activated replicas (measured by running the routers), resident or offloaded experts;
* :mod:`moejax.pipeline_sim.pipeline` -- the composition: techniques on or off, one run,
  its figures.
"""
