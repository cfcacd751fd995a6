"""torch.library custom ops of v41graph (installed as v41graph.custom_ops)."""
from . import codecs, ops, reference, streams  # noqa: F401  (importing registers torch.ops.v41graph.*)
