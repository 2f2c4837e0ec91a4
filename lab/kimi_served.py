"""The served width check on the Kimi-shaped target, its two negative controls, and the controls of served tau
(docs/KIMI.md). OUT is a lab/kimi_reduced_run.sh result dir (target/, run/export/sglang):

    python lab/kimi_served.py checks OUT                 # the three checks below -> OUT/served.json
    python lab/kimi_served.py untrained OUT DEST         # DEST: the run's export as the trainer starts it
    python lab/kimi_served.py capture-off MODULE ARG...  # python -m MODULE ARG... with aux capture switched off

The checks, each in its own process (each builds the target in SGLang afresh):

* ``trained``: the run's export on its target: must pass;
* ``capture_off``: the same, with the target class's ``set_eagle3_layers_to_capture`` made a no-op
  before SGLang builds it, as in a class without aux capture (the field failure): must fail, naming it;
* ``wrong_width``: a copy of the export whose ``fc`` was trained on a 576-wide target (SmolLM2's
  width, three aux states): must fail, naming the widths.

``untrained`` and ``capture-off`` are the two controls of served tau on a target of dummy weights (a target
without language, so tau only compares): the same export untrained, and the trained one with capture off
(``capture-off serving.sglang_eval ...``: the switch is made a no-op in every process SGLang spawns too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

CAPTURE_OFF = "STREAMDRAFT_LAB_CAPTURE_OFF"  # set: this module, imported in a process SGLang spawns, switches capture off
WRONG_HIDDEN = 576  # the width of the embedded SmolLM2 target: a draft trained there


def wrong_width_export(export: Path, out: Path) -> Path:
    """A copy of ``export`` whose fc takes 3 x WRONG_HIDDEN values a token and whose config says so."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in export.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = load_file(str(export / "model.safetensors"))
    fc = tensors["fc.weight"]  # [H_d, A * H]
    tensors["fc.weight"] = torch.zeros(fc.shape[0], 3 * WRONG_HIDDEN, dtype=fc.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((export / "config.json").read_text())
    config["target_hidden_size"] = WRONG_HIDDEN
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def switch_capture_off() -> None:
    """Make every Kimi model class's capture switch a no-op, as in a class without aux capture."""
    # first, as in SGLang's own start: its guarded import of flashinfer.comm (which needs cuda.tile, absent from an
    # install without it) leaves the submodules in sys.modules that the model modules import by name
    import sglang.srt.layers.flashinfer_comm_fusion  # noqa: F401
    import sglang.srt.models.deepseek_v2 as deepseek
    import sglang.srt.models.kimi_k25 as kimi

    for cls in (kimi.KimiK25ForConditionalGeneration, deepseek.DeepseekV2ForCausalLM):
        cls.set_eagle3_layers_to_capture = lambda self, layer_ids=None: None


def run_capture_off(module: str, argv: list[str]) -> None:
    """``python -m module argv`` with capture off here and, through CAPTURE_OFF, in each spawned process (spawn
    imports this file as its main module)."""
    os.environ[CAPTURE_OFF] = "1"
    switch_capture_off()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__")


def untrained_export(export: Path, out: Path, device: str = "cpu", lm_head_scale: float = 1.0) -> Path:
    """A copy of ``export`` holding the draft as the trainer starts it on the dummy target: each linear weight
    [out, in] as ``nn.Linear`` draws it (uniform in +-1/sqrt(in)), each norm weight 1, lm_head the draft-vocab
    rows of the trainer's target head (lab/kimi_reduced.dummy_head drawn on ``device``, times ``lm_head_scale``),
    the vocab map kept."""
    import torch
    from safetensors.torch import load_file, save_file

    from lab.kimi_reduced import dummy_head

    out.mkdir(parents=True, exist_ok=True)
    for f in export.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = load_file(str(export / "model.safetensors"))
    d2t, t2d = tensors["d2t"], tensors["t2d"]  # [V_d] offsets to target ids, [V_t] bool
    fresh = {"d2t": d2t, "t2d": t2d}
    for name, t in tensors.items():
        if name in fresh:
            continue
        if name.endswith("lm_head.weight"):  # [V_d, H]: the target head's [V_t, H] rows of the draft vocab
            fresh[name] = dummy_head(t2d.numel(), t.shape[1], device, lm_head_scale)[d2t.long() + torch.arange(d2t.numel())]
        elif name.endswith("embed_tokens.weight"):
            fresh[name] = dummy_head(t2d.numel(), t.shape[1], device)
        elif t.dim() == 1:
            fresh[name] = torch.ones_like(t)
        else:
            bound = 1 / math.sqrt(t.shape[1])
            fresh[name] = torch.empty(t.shape, dtype=torch.float32).uniform_(-bound, bound).to(t.dtype)
    save_file(fresh, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_check(name: str, argv: list[str], capture_off: bool = False) -> dict:
    cmd = [sys.executable, *([__file__, "capture-off"] if capture_off else ["-m"]), "serving.served_check", *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in (p.stdout + p.stderr).splitlines() if "served check" in line]
    print(f"{name}: exit {p.returncode}: {lines[-1] if lines else (p.stderr.strip().splitlines() or [''])[-1]}", flush=True)
    return {"rc": p.returncode, "message": lines, "tail": (p.stdout + p.stderr)[-3000:]}


def caught(check: dict, cause: str) -> bool:
    """The check failed, and for ``cause``: a control that fails for another reason (an import, a crash) catches nothing."""
    return check["rc"] == 1 and any(cause in line for line in check["message"])


def checks(out: Path) -> dict:
    target, export = out / "target", out / "run" / "export" / "sglang"
    common = ["--target", str(target), "--load-format", "dummy"]
    wrong = wrong_width_export(export, out / "wrong_width_export")
    result = {
        "trained": run_check("trained", [str(export), *common]),
        "capture_off": run_check("capture_off", [str(export), *common], capture_off=True),
        "wrong_width": run_check("wrong_width", [str(wrong), *common]),
    }
    result["controls_caught"] = (
        result["trained"]["rc"] == 0
        and caught(result["capture_off"], "aux capture is not switched on")
        and caught(result["wrong_width"], f"trained on a {WRONG_HIDDEN}-wide target")
    )
    (out / "served.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(wrong)
    print(f"served checks: {'as expected' if result['controls_caught'] else 'NOT as expected'}")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("checks", help="the served width check and its two controls").add_argument("out", type=Path)
    u = sub.add_parser("untrained", help="the run's export as the trainer starts it")
    u.add_argument("out", type=Path)
    u.add_argument("dest", type=Path)
    u.add_argument("--device", default="cuda", help="where the dummy head is drawn (cuda: the values SGLang serves)")
    c = sub.add_parser("capture-off", help="python -m MODULE ARG... with aux capture switched off")
    c.add_argument("module")
    c.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.command == "checks":
        checks(a.out)
    elif a.command == "untrained":
        scale = json.loads((a.out / "target" / "provenance.json").read_text())["lm_head_scale"]  # lab/kimi_reduced.py's
        print(f"wrote {untrained_export(a.out / 'run' / 'export' / 'sglang', a.dest, a.device, scale)}")
    else:
        run_capture_off(a.module, a.args)


if os.environ.get(CAPTURE_OFF) and __name__ == "__mp_main__":
    switch_capture_off()
if __name__ == "__main__":
    main()
