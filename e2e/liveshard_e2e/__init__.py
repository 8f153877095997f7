"""A real local Kubernetes cluster for liveshard's end-to-end tests and demo.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes built
from their Go modules (``e2e/build.sh``); a Python *process kubelet* (:mod:`liveshard_e2e.kubelet`)
registers fake nodes and runs each bound pod's containers as local process groups. The product
never imports this package.
"""
