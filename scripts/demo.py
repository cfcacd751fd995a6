"""Same as `python -m v41graph.demo`."""
from v41graph.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
