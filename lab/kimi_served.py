"""The served width check on the Kimi-shaped target, with its two negative controls (docs/KIMI.md).

    python lab/kimi_served.py OUT        # OUT: a lab/kimi_reduced_run.sh result dir (target/, run/export/sglang)

Three checks, each in its own process (each builds the target in SGLang afresh), written to
OUT/served.json with their exit codes and messages:

* ``trained``: the run's export on its target: must pass;
* ``capture_off``: the same, with the target class's ``set_eagle3_layers_to_capture`` made a no-op
  before SGLang builds it, as in a class without aux capture (the field failure): must fail, naming it;
* ``wrong_width``: a copy of the export whose ``fc`` was trained on a 576-wide target (SmolLM2's
  width, three aux states): must fail, naming the widths.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

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


def capture_off_then_check(argv: list[str]) -> int:
    """``serving.served_check`` with every SGLang model class's capture switch made a no-op."""
    import sglang.srt.models.deepseek_v2 as deepseek
    import sglang.srt.models.kimi_k25 as kimi

    from serving.served_check import main

    for cls in (kimi.KimiK25ForConditionalGeneration, deepseek.DeepseekV2ForCausalLM):
        cls.set_eagle3_layers_to_capture = lambda self, layer_ids=None: None
    return main(argv)


def run_check(name: str, argv: list[str], capture_off: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--capture-off-check", *argv] if capture_off else [sys.executable, "-m", "serving.served_check", *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in (p.stdout + p.stderr).splitlines() if "served check" in line]
    print(f"{name}: exit {p.returncode}: {lines[-1] if lines else (p.stderr.strip().splitlines() or [''])[-1]}", flush=True)
    return {"rc": p.returncode, "message": lines, "tail": (p.stdout + p.stderr)[-3000:]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    target, export = a.out / "target", a.out / "run" / "export" / "sglang"
    common = ["--target", str(target), "--load-format", "dummy"]
    wrong = wrong_width_export(export, a.out / "wrong_width_export")
    result = {
        "trained": run_check("trained", [str(export), *common]),
        "capture_off": run_check("capture_off", [str(export), *common], capture_off=True),
        "wrong_width": run_check("wrong_width", [str(wrong), *common]),
    }
    result["controls_caught"] = result["trained"]["rc"] == 0 and result["capture_off"]["rc"] == 1 and result["wrong_width"]["rc"] == 1
    (a.out / "served.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(wrong)
    print(f"served checks: {'as expected' if result['controls_caught'] else 'NOT as expected'}")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--capture-off-check"]:
        sys.exit(capture_off_then_check(sys.argv[2:]))
    main()
