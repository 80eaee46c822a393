"""gRPC plumbing shared by the router and the workers: server start-up, TLS and tokens, health, metrics,
start-up status, worker discovery, and the workers' internal messages <-> engine types."""
