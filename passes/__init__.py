"""FX passes of the v41graph backend (installed as v41graph.passes)."""
