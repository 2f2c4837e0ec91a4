"""``python -m trainer.report RUN_DIR [--out DIR]``: the offline report of a run (``trainer.report.report``)."""

from trainer.report.report import main

main()
