"""Parallel layouts and the regions of logical tensors that each rank holds under them.

Pure: imports neither torch, grpc nor kubernetes.
"""
