"""moe-serve's HTTP service and command line."""
