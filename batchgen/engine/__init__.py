"""The paged engine: sequences, block manager, scheduler (pure Python), sampler, beam search, engine loop."""
