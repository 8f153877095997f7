"""The agent's gRPC server: the API of `proto/`, its authentication, and the pod's process.
Drives the runtime; holds no training logic."""
