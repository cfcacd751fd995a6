"""v41graph: DeepSeek-V4.1-Flash as plain torch modules, compiled through our own backend."""
from .config import V41Config
from .layer_plan import LayerRole, build_layer_plan, format_layer_plan

__all__ = ["V41Config", "LayerRole", "build_layer_plan", "format_layer_plan"]
