"""The transfer engine: sharded state, worlds of process groups, the executor of a schedule and
the switch transaction (prepare, switch, commit or abort).

`backend` is the one module that touches torch's private or backend-specific API. The engine
neither trains nor talks to Kubernetes.
"""
