"""Tools around the service: the local cluster behind `disagg serve`, the load generator, the soak run,
the tiny offline checkpoints, and the model-support sweep."""
