"""The process kubelet: fake nodes whose pods run as local process groups.

It registers nodes with capacity, keeps their leases and Ready condition fresh, runs each bound
pod's containers with the environment a real kubelet would give, reports pod status, honours
restart policies and graceful deletion, and serves container logs to ``kubectl logs``. It never
touches a pod that is not bound to one of its nodes.
"""
