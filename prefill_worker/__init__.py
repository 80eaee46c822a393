"""The prefill worker: encodes prompts, samples the first token on the device, and
sends the prompt's KV straight to the reserved decode slot.

Lifecycle of a request here, in order:
1. `Prefill` arrives with token ids, sampling and (usually) a KV target; a target
   outside the decode pool (`--decode`, peers.py) is refused before anything else.
2. It waits for the device thread (one prompt at a time, as NxDI's ctx_batch_size=1).
   There, the prompt's leading whole blocks found in the prefix cache
   (prefix_cache.py) are taken from it, and only the rest is computed.
3. As each layer's K/V is computed, it is cut into pieces for the decode
   worker's `PushKv`; on an accelerator they are sent at once, overlapping the
   remaining layers, on a CPU right after the first token (config.py says why).
4. The first token is returned to the router at once; the commit (carrying the
   first token) closes the transfer, and `kv_sent` reports the acknowledgement.
"""
