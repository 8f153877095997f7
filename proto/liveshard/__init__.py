"""The generated Python code of liveshard's gRPC contract (proto/liveshard)."""
