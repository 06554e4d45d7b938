"""Generated gRPC stubs of the diloco.v1 wire contract (see protos/); regenerate with protos/generate.py."""
