"""Everything StreamDraft does with transformers as an outside engine.

- ``target``: feature capture (``engine.name=hf``): the target factories an engine process builds ``models.target.HFTargetEngine`` from
- ``generate``: generation (``--engine hf``): transformers ``generate`` in left-padded batches
"""
