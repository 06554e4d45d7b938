"""The trained model out: the global model assembled from the syncer shards (live, or from their checkpoint
files), written as safetensors plus a JSON config, and text sampled from it."""
