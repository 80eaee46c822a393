"""The torch backend's CPU kernels: C sources built on first use, each with a pure-torch fallback."""
