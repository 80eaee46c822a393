"""The decode worker: KV slots, continuous batching, on-device sampling, the async step loop.

Lifecycle of a request here, in order:
1. `Decode` stream opens: a slot is reserved under a lease (worker.reserve).
2. A prefill worker streams the KV and the first token into it (`PushKv`).
3. The slot joins the running batch (DecodeLoop.admit); tokens stream back.
4. On a stop, a cancel or a failed transfer, the slot is freed once no step
   in flight touches it.
"""
