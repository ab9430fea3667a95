"""The decode runtime: the paged KV cache (``paged``; its blocks are kept by
``moejax.kv.BlockAllocator``), the step programs (``programs``: fused and layer by layer)
and the runners that place the weights (``runners``: resident, offload; ``sync_ep``;
``factory.make_runner`` builds one by backend name). The continuous-batching scheduler
that drives them is ``moejax.core.continuous``."""
