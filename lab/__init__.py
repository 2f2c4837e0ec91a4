"""Experiment tooling: benchmarks, studies, fault runs and GPU-host scripts, run from a checkout
(``python lab/NAME.py``), importable as ``lab.NAME``; no part of the installed package."""
