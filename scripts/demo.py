"""Same as `python -m v41graph.tools.demo`."""
from v41graph.tools.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
