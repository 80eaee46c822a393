"""How KV moves between the workers.

- gRPC stream (push, the portable fallback): the prefill worker streams KvChunk
  pieces to the decode worker's PushKv (`disagg.engine.kv_wire` cuts and checks
  them, `disagg.wire` frames them).
- NIXL (pull, `nixl_transport`): the prefill worker stages the KV in registered
  host memory and calls PullKv; the decode worker reads it straight into the
  slot. `--kv-transport nixl` on both workers.
"""

TRANSPORTS = ("grpc", "nixl")
