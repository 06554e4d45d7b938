"""Decoupled DiLoCo: islands of accelerators train apart and merge fragments through syncer shards.

The package is layered (docs/architecture.md): `core` (the algorithm), `transport` (the wire contract), the
process runtime (`settings`, `logs`, `progress`), `api` (the DiLoCoJob model), the components `syncer`,
`worker` and `operator` (mapped from the repository's top-level folders), then `local` (`diloco run`) and
`sim` (`diloco simulate`), and the command line on top.
"""

__version__ = "0.1.0"
