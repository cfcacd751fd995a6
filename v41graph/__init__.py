"""v41graph: DeepSeek-V4.1-Flash as plain torch modules, compiled through our own backend."""
from .config import V41Config
from .layer_plan import LayerRole, build_layer_plan, format_layer_plan
from .accounting import accounting
from .cache import AttentionMetadata, BlockAllocator, CacheCapacityError, ModelCaches, build_metadata
from .model import V41Model, init_random_
from .session import Session
from .loader import ShardSpec, from_pretrained, load_sharded_state_dict, save_pretrained
from .checkpoint import CheckpointError
from .engine import Engine
from .sampling import SamplingParams
from .compiler import CompiledModel, compile  # noqa: A004  (v41graph.compile is the API)

__all__ = ["V41Config", "LayerRole", "build_layer_plan", "format_layer_plan", "accounting",
           "AttentionMetadata", "BlockAllocator", "CacheCapacityError", "ModelCaches",
           "build_metadata", "V41Model", "init_random_", "Session", "from_pretrained", "save_pretrained", "ShardSpec", "load_sharded_state_dict", "CheckpointError", "compile", "CompiledModel", "Engine", "SamplingParams"]
