"""KServe v2 over gRPC: the servicer and the protobuf codec."""
