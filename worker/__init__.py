"""The worker: turns a PyTorch training loop into a Decoupled DiLoCo learner (island)."""
