"""The model as plain torch modules: config, layer plan, layers, mHC, MoE, Engram, attention,
DSpark, the model itself, the step metadata and the caches."""
