"""Launchers and benchmarks: scripts run from a checkout (``python launch/NAME.py``), importable as ``launch.NAME``."""
