"""What a run reports: metrics and where they go, and the pictures of them.

- ``metrics``: metric names (one place) and the sink: wandb (offline by default) + ``metrics.jsonl``
- ``panels``: the sections and panels both the wandb workspace and the offline report draw
- ``runlog``: a finished run read back (``metrics.jsonl`` + ``summary.json``, or its wandb run)
- ``plots``: one PNG a section
- ``report``: the offline Markdown report and the compact end-of-run summary (``python -m trainer.report``)
- ``card``: the model card (``README.md``) in each export dir

The wandb workspace of the same panels is ``python -m trainer.dashboard``.
"""
