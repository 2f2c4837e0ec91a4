"""Everything StreamDraft does with SGLang 0.5.14 (docs/SGLANG.md).

- ``preflight``: from SGLang's source, before a weight loads: the target class captures our aux layers; the attention backend
- ``target``: feature capture (``engine.name=sglang``): one tensor-parallel rank of a ``ModelRunner`` with EAGLE-3 aux capture
- ``generate``: generation (``--engine sglang``): the offline ``sglang.Engine``, token ids in and out
- ``spec_decode``: τ in SGLang's own EAGLE-3 decoding (``serving.sglang_eval``): the chain engine and its per-request counters
- ``speedup_engine``: one engine process of ``serving.speedup`` (``python -m models.backends.sglang.speedup_engine JOB RESULT``)
"""
