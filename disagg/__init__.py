"""disagg: disaggregated LLM inference over gRPC.

Packages: `disagg.engine` (backends, slots, sampler, KV codec), `disagg.v1`
(generated stubs), `disagg.client` (Python client); the servers are the
top-level `router`, `prefill_worker` and `decode_worker` packages.
"""

__version__ = "0.1.0"
