"""The StreamDraft entry points run from a checkout: ``launch/train.py`` (the DeepSpeed launcher's script) and
``launch/recipe.py`` (the GPU recipe), importable as ``launch.NAME``."""
