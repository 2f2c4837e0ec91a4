"""Everything StreamDraft does with SGLang 0.5.14 (docs/SGLANG.md).

- ``preflight``: from SGLang's source, before a weight loads: the target class captures our aux layers; the attention backend
- ``target``: feature capture (``engine.name=sglang``): one tensor-parallel rank of a ``ModelRunner`` with EAGLE-3 aux capture
- ``generate``: generation (``--engine sglang``): the offline ``sglang.Engine``, token ids in and out
"""
