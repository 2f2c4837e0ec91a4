"""Data generation by the target: the backends and the prompt synthesis behind
``python -m trainer.regenerate`` and ``python -m trainer.synthesize`` (docs/DATA.md).

- ``gen_backend``: token-id prompts in, replies out, by the generator of the backend ``--engine`` names (``models.backends``)
- ``synth``: seeds, jobs, filters and the resumable pipeline of synthesized user prompts
"""
