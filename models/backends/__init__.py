"""The outside engines StreamDraft runs a target in: one folder each (``hf``, ``sglang``), and one entry each in
``registry.BACKENDS`` saying what it can do."""
