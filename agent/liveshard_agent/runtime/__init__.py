"""The training runtime: the parallel model whose parameters are the engine's sharded state, the
optimizer, the data cursor, layout-independent randomness, the training loop and checkpoints.
Built on the engine; must not talk to Kubernetes."""
