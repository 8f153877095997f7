"""liveshard's Kubernetes operator: reconciles ElasticTrainingJobs with kopf.

It renders the job's pods, Secret and PodDisruptionBudget (`render`, pure functions), chooses
layouts (`policy`, over the pure core), and drives reconfigurations through the agents' gRPC API
(`agents`), one idempotent step at a time (`controller`): each pass observes the job (`observe`),
decides its next step as values (`decide`, pure: actions and the status to write) and carries it
out (`act`), keeping its progress in the job's status (`world.Record`) so that a restarted
operator resumes. It imports neither torch nor the agent package.
"""
