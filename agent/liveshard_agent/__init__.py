"""liveshard's in-pod agent: the transfer engine, and (to come) the training runtime and server.

Layers, each importing only those below it (import-linter contracts keep the arrows down):
`server` > `runtime` > `engine` > `liveshard_core` (the pure core, shared with the operator).
"""
