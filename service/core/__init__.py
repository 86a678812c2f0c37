"""The transport-free core every ingress calls: the runtime, the forward, KServe inference."""
