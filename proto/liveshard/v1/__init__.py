"""liveshard gRPC contract, generated Python code: version 1 (`scripts/proto`)."""
