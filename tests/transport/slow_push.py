"""Run inside an island's namespace by test_slow_link.py: one push of `floats` float32 values to the shard at
`target`, through the island's shaped link, tried once with the client's deadline for its bytes (a `base` of
seconds plus its bytes at `min_mbps`). Prints JSON: the call's status code and how long it took."""

import json
import sys
import time
from pathlib import Path

import grpc
import torch

from diloco.core.encoding import Encoding
from diloco.transport.client import SyncerClient
from diloco.transport.tls import Tls


def main(target: str, ca_file: str, token: str, base: float, min_mbps: float, floats: int) -> None:
    security = Tls(ca=Path(ca_file).read_bytes())
    with SyncerClient(
        target, token, security=security, island_id="far", timeout=base, min_transfer_mbps=min_mbps, retry_for=0
    ) as client:
        client.join(1)
        version = client.status().fragments[0].version
        started = time.monotonic()
        try:
            client.push(
                0,
                base=version,
                tokens=1,
                inner_steps=1,
                sequence=1,
                delta=[("w", torch.full((floats,), 0.5))],
                encoding=Encoding.FP32,
                block_size=0,
            )
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
    print(json.dumps({"code": code.name, "seconds": time.monotonic() - started}))


if __name__ == "__main__":
    target, ca_file, token, base, min_mbps, floats = sys.argv[1:]
    main(target, ca_file, token, float(base), float(min_mbps), int(floats))
