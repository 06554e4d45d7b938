"""The syncer shard: a gRPC server that merges fragment deltas from islands with an outer optimizer."""
