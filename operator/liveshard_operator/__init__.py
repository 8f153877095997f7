"""liveshard's Kubernetes operator: reconciles ElasticTrainingJobs with kopf.

It renders the job's pods, Secret and PodDisruptionBudget (`render`, pure functions), chooses
layouts (`policy`, over the pure core), and drives reconfigurations through the agents' gRPC API
(`agents`), one idempotent step at a time (`controller`), keeping its progress in the job's
status so that a restarted operator resumes. It imports neither torch nor the agent package.
"""
