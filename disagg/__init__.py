"""disagg: disaggregated LLM inference over gRPC.

The three services are the top-level `router`, `prefill_worker` and `decode_worker`
packages. What they share, one role a package: `disagg.engine` (model execution:
backends, CPU kernels, slot manager, sampler), `disagg.kv_transport` (KV from
prefill to decode), `disagg.rpc` (gRPC plumbing), `disagg.v1` (generated stubs),
`disagg.clients` (Python clients), `disagg.cli` (the `disagg` command) and
`disagg.tools` (local cluster, load generator, soak, tiny models, sweep).
"""

__version__ = "0.1.0"
