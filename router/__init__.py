"""The router: the public GenerationService.

It owns the client connection, the tokenizer, validation, worker choice, the
incremental detokenizer and stop sequences. Per request, in order:
1. validate and tokenize (validation.py);
2. take a decode slot: wait in the bounded admission queue, then open the
   decode worker's Decode stream, which reserves the slot (workers.py);
3. prefill on the least-loaded prefill worker, which sends the KV straight
   to the reserved slot; stream the first token at once (lifecycle.py);
4. stream the decode worker's tokens as text deltas, applying stop sequences
   (detokenizer.py); cancel every worker call when the client goes away.
"""
