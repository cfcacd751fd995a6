"""What runs the model step by step: the shared step runner (caches, allocator, persistent decode
rows), Session, the serving Engine, sampling and speculative decoding."""
