"""Atomic, resumable checkpoints: DeepSpeed state + position + what the run was trained on.

A checkpoint is ``<run_dir>/checkpoints/step_<N>/`` holding DeepSpeed's files (the draft's
trained parameters, optimizer, LR scheduler, RNG; every rank writes its own shards) under
``state/``, the vocab map, and ``meta.json`` (position, the data loader's state, fingerprint,
wandb run id, resolved config). Frozen parameters (the target's embedding) are not saved: a
resume rebuilds them from the target, whose embedding digest is in the fingerprint. It is
written under a temporary name and renamed when every rank has finished, so a crash during a
save leaves the previous checkpoint whole; directories that are not complete checkpoints are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from models.vocab_map import VocabMap

META_FILE = "meta.json"
VOCAB_FILE = "vocab_map.safetensors"
STATE_TAG = "state"
_NAME = re.compile(r"^step_(\d+)$")

CHANGEABLE = ("data", "schedule")  # the fingerprint's parts a resume may change on purpose (trainer.resume_allow)


@dataclass
class Position:
    step: int  # optimizer steps done
    epoch: int  # epoch in progress
    micro: int  # micro-batches of that epoch already consumed (on every rank)
    train_s: float = 0.0  # training seconds up to here, over every resume (rank 0's; trainer.max_time_s counts them)
    schedule_start_s: float | None = None  # a time-capped run's seconds at its first step's end (trainer.schedule.RunClock)
    schedule_from_step: int = 0  # the step its LR schedule starts at (trainer.schedule.ScheduleStart)
    continued: bool = False  # that schedule continues a trained draft (peak lr x schedule.continue_lr_ratio)


def vocab_digest(vocab: VocabMap) -> str:
    h = hashlib.sha256(vocab.d2t.cpu().numpy().tobytes())
    h.update(vocab.t2d.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a tensor's dtype, shape and bytes (any dtype, bfloat16 included)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(saved: dict, now: dict, allow: list[str]) -> list[str]:
    """Fingerprint keys (dotted, e.g. ``draft.draft_vocab_size``) whose values differ, except those
    under a top-level key in ``allow``; one line each."""
    saved, now = _flat(saved), _flat(now)
    out = []
    for key in sorted(saved.keys() | now.keys()):
        if key.split(".")[0] in allow or saved.get(key) == now.get(key):
            continue
        was, is_ = (repr(d[key]) if key in d else "absent" for d in (saved, now))
        out.append(f"{key}: {was} in the checkpoint, {is_} now")
    return out


def is_complete(path: Path) -> bool:
    return bool(_NAME.match(path.name)) and (path / META_FILE).is_file() and (path / STATE_TAG).is_dir()


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if is_complete(p)]
    return max(done, key=lambda p: int(_NAME.match(p.name).group(1)), default=None)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    ds_model,
    root: Path,
    pos: Position,
    data_state: dict,
    fingerprint: dict,
    vocab: VocabMap,
    config: dict,
    keep_last: int,
    is_main: bool,
    wandb_id: str | None,
    kept: bool = False,
) -> Path:
    """Every rank calls this. ``data_state`` is the data loader's position (``MixLoader.state_for``);
    ``wandb_id`` the run's wandb id (rank 0; None before wandb starts), which a resume continues; a ``kept``
    checkpoint is never pruned (``trainer.checkpoint_at_s``)."""
    final = root / f"step_{pos.step}"
    tmp = root / f".tmp-step_{pos.step}"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    try:
        ds_model.save_checkpoint(
            str(tmp), tag=STATE_TAG, client_state={"rng": _rng_state()}, save_latest=False, exclude_frozen_parameters=True
        )
        torch.distributed.barrier()
        if is_main:
            vocab.save(tmp / VOCAB_FILE)
            meta = {"position": asdict(pos), "data_state": data_state, "fingerprint": fingerprint, "wandb_id": wandb_id, "config": config}
            meta["kept"] = kept
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _prune(root, keep_last)
    except OSError as e:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"checkpoint save to {final} failed ({e}); the previous checkpoint is kept") from e
    torch.distributed.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    """The complete checkpoints past the newest ``keep_last`` removed, the kept ones aside."""
    done = [p for p in root.iterdir() if is_complete(p) and not read_meta(p).get("kept")]
    done.sort(key=lambda p: int(_NAME.match(p.name).group(1)))
    for old in done[:-keep_last]:
        shutil.rmtree(old)


def read_meta(path: Path) -> dict:
    if not is_complete(path):
        raise ValueError(f"{path}: not a complete StreamDraft checkpoint (needs {META_FILE} and {STATE_TAG}/)")
    return json.loads((path / META_FILE).read_text())


def _load_trained(src: dict, dst: torch.nn.Module) -> None:
    """Load a checkpoint's module state into ``dst``: every trained parameter, strictly; the
    frozen ones stay as built from the target (they are not saved)."""
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    result = dst.load_state_dict(src, strict=False)
    missing, unexpected = sorted(set(result.missing_keys) - frozen), sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"checkpoint state does not match the draft: missing {missing}, unexpected {unexpected}")


def load(ds_model, path: Path) -> tuple[Position, dict]:
    """Restore DeepSpeed state and RNG from ``path``; returns the position and the data loader state."""
    meta = read_meta(path)
    load_path, client = ds_model.load_checkpoint(
        str(path), tag=STATE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True, custom_load_fn=_load_trained
    )
    if load_path is None:
        raise ValueError(f"{path}: DeepSpeed found no state under {STATE_TAG}/")
    _set_rng_state(client["rng"])
    return Position(**meta["position"]), meta["data_state"]
