"""The shared engine: backends, slot manager, sampler, stopping rules and KV wire codec.

Both workers use it; nothing here knows about gRPC or protobuf.
"""
