"""Transfer plans between layouts and the round schedules that execute them.

Pure: imports neither torch, grpc nor kubernetes.
"""
