"""Offline mode for the command-line tools: nothing is fetched from a hub."""

import os
import sys


def offline() -> None:
    """Set ``HF_HUB_OFFLINE=1`` unless the environment sets it already, for this process and the
    processes it starts. huggingface_hub reads the variable once, at its import: when it is
    imported already, its constant is set too."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
