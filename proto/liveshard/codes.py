"""What a gRPC status code of the agent API means to its callers, the operator and a pod's proxy
alike."""

from __future__ import annotations

import grpc

# The codes of a call that the agent may take later: it could not be reached, or did not answer
# in time. Its caller sends it again soon rather than giving up.
MAY_ANSWER_LATER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
