"""Weights in the released checkpoint layout: the format, official names, loading, saving,
random checkpoints, sharding, DSpark loading and the parameter / KV accounting."""
