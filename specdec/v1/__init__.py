"""Generated protobuf and gRPC stubs of proto/specdec/v1 (python -m specdec.protogen)."""
