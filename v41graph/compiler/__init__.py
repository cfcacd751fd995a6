"""The v41graph torch.compile backend, the compiled model (decode buckets, capture), the
lowerings (Inductor segments, torchair on Ascend) and the graph-dump format."""
