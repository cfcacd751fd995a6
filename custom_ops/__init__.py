"""torch.library custom ops of v41graph (installed as v41graph.custom_ops)."""
from . import codecs, hooks, ops, reference, stamp_tag, streams  # noqa: F401  (importing registers torch.ops.v41graph.*)
from . import cuda_impls, npu_impls  # noqa: F401  CUDA (Triton) / NPU (torch_npu) kernels; both import lazily
