"""AsyncMoE decode core: token records, μ-queues, token pool, schedulers, engine, simulator."""
