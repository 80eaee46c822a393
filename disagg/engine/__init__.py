"""The shared engine: backends (`backends/`), the CPU kernels (`cpu_kernels/`), the slot manager, the sampler
and the request rules every edge checks with.

Both workers use it; nothing here knows about gRPC, protobuf or the command line.
"""
