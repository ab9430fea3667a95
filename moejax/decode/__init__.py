"""The decode runtime: the paged KV cache (``paged``, ``blocks``), the step programs
(``programs``: fused and layer by layer) and the runners that place the weights
(``runners``: resident, offload, sync_ep). The continuous-batching scheduler that drives
them is ``serving.continuous``."""
