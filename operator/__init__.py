"""The Kubernetes operator: reconciles DiLoCoJob resources into islands and syncer shards."""
