"""liveshard's in-pod agent and the pure core it shares with the operator.

The subpackages `vps`, `layout` and `plan` are the pure core: they describe training state, layouts
and transfer plans without importing torch, grpc or kubernetes, so the operator can use them too.
"""
