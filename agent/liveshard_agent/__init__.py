"""liveshard's in-pod agent: the transfer engine, the training runtime and the gRPC server.

Layers, each importing only those below it (import-linter contracts keep the arrows down):
`server` > `runtime` > `engine` > `liveshard_core` (the pure core, shared with the operator).
"""
