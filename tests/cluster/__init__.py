"""The cluster tier's machinery: a real control plane with KWOK nodes (cluster.py) and a local pod runner."""
