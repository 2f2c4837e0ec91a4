"""The StreamDraft Hydra app under the DeepSpeed launcher.

    deepspeed --no_local_rank launch/train.py +experiment=smoke
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank launch/train.py +experiment=smoke

``--no_local_rank`` keeps the launcher from passing ``--local_rank``, which Hydra rejects;
ranks read RANK / LOCAL_RANK / WORLD_SIZE from the environment instead. ``--verbose`` works
as with ``python -m trainer``.
"""

from trainer.__main__ import cli

if __name__ == "__main__":
    cli()
