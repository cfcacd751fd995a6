"""Where the golden vectors of DeepSeek's reference live: $V41_GOLDEN_DIR, else the copy in
tests/data (so CI has them on a clean clone), else the workspace's ../shared folder."""
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CANDIDATES = [Path(os.environ["V41_GOLDEN_DIR"])] if os.environ.get("V41_GOLDEN_DIR") else []
_CANDIDATES += [_HERE / "data/golden_v41_tiny", _HERE.parents[1] / "shared/golden/golden_v41_tiny"]
GOLDEN_DIR = next((p for p in _CANDIDATES if (p / "model.safetensors").is_file()), _CANDIDATES[0])
