"""Command-line tools: the `v41graph` CLI, the graph-dump reader behind `v41graph inspect`, the demo."""
