"""v41graph: DeepSeek-V4.1-Flash as plain torch modules, compiled through our own backend."""
from v41graph.model.config import V41Config
from v41graph.model.kv_cache import ModelCaches
from v41graph.model.layer_plan import LayerRole, build_layer_plan, format_layer_plan
from v41graph.model.metadata import AttentionMetadata, build_metadata
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.batch import BlockAllocator, CacheCapacityError
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams
from v41graph.runtime.session import Session
from v41graph.weights.accounting import accounting
from v41graph.weights.checkpoint import CheckpointError
from v41graph.weights.load import from_pretrained
from v41graph.weights.save import save_pretrained
from v41graph.weights.sharding import ShardSpec, load_sharded_state_dict
from v41graph.compiler.compiled_model import CompiledModel, compile  # noqa: A004  (v41graph.compile is the API)
from v41graph.parallel import ParallelConfig, init_parallel

__all__ = ["V41Config", "LayerRole", "build_layer_plan", "format_layer_plan", "accounting",
           "AttentionMetadata", "BlockAllocator", "CacheCapacityError", "ModelCaches",
           "build_metadata", "V41Model", "init_random_", "Session", "from_pretrained",
           "save_pretrained", "ShardSpec", "load_sharded_state_dict", "CheckpointError", "compile",
           "CompiledModel", "Engine", "SamplingParams", "ParallelConfig", "init_parallel"]
