"""moe-serve's HTTP and gRPC service and command line."""
