"""Prompt synthesis: the target (or another generator) writes new user prompts (``python -m
trainer.synthesize``; docs/DATA.md, "Synthetic prompts").

- ``seeds``: the categories, kinds of request and personas the generator is seeded with
- ``instructions``: jobs (a pure function of seed and index) and the generator's instructions
- ``filters``: clean-up, then length, language and refusal / meta-text checks
- ``pipeline``: batches, near-duplicate removal (``trainer.data.dedup``), follow-ups, resumable output
"""
