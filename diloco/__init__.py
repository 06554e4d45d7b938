"""Decoupled DiLoCo: islands of accelerators train apart and merge fragments through syncer shards.

Shared, mostly pure code lives here (configuration, fragmenting, encodings, merge rules, the outer
optimizer, the wire helpers and the syncer client); the components are the subpackages
`diloco.syncer`, `diloco.worker` and `diloco.operator`, mapped from the top-level folders of the repo.
"""

__version__ = "0.1.0"
