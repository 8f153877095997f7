"""The Virtual Parameter Space: logical tensors, boxes of their index space, and model specs.

Pure: imports neither torch, grpc nor kubernetes.
"""
