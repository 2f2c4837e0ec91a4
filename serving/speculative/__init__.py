"""Real greedy chain speculative decoding with an exported draft (``python -m serving.eval``).

- ``draft_runner``: the draft as an engine runs it (incremental KV cache, SGLang's wiring)
- ``target_runner``: the target as the verifier, handing out the features the draft reads
- ``decode``: draft k tokens, verify them in one target forward, keep the agreeing prefix
"""
