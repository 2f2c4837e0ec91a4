"""Peak host and GPU memory of the trainer process's target loading: the whole model vs TargetHead.

    python3 lab/bench_trainer_memory.py --device cuda --out mem.json             # H200: 8B shape, 32 layers, 16 GB
    python3 lab/bench_trainer_memory.py --layers 4 --shard-gb 1 --out mem.json   # CPU: 8B widths, 4 layers, 3.9 GB

Writes a Llama-3.1-8B-shaped checkpoint (hidden 4096, intermediate 14336, 32/8 heads, vocab
128256; ``--layers`` decoder layers, 32 by default) with seeded random bf16 weights as
sharded safetensors with a ``model.safetensors.index.json`` (``--shard-gb`` a shard), plus a
small word-level tokenizer, into a temporary dir (removed after, unless ``--keep``; or reuse
``--dir``). Fewer layers keep the embedding and lm_head (2 x 1.05 GB) and shrink only the
decoder. Then, each in a fresh subprocess, measures what ``trainer.target_setup.load_target``
does per ``engine.mode``:

- ``whole``: ``HFTargetEngine.from_path`` + the tokenizer: the whole transformers model, what
  the trainer process loads in ``inprocess`` mode (and, before TargetHead, in every mode);
- ``head``: ``TargetHead.from_path``: config, tokenizer, embedding and lm_head read by tensor
  name (``colocated`` mode and ``engine=sglang``);
- ``baseline``: the same imports (and CUDA context) with nothing loaded.

Per row: host peak (VmHWM of /proc/self/status: the resident-set high-water mark), host
resident after the load (VmRSS) — both after one value of every memory page of the host
weights was read (transformers and safetensors map the files lazily; a trainer reads them
all) — the weights' bytes held, GPU peak and held (torch.cuda.max_memory_allocated /
memory_allocated), and load seconds. Needs only torch, transformers and safetensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import torch  # noqa: E402

from models import hub  # noqa: E402

SHAPE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
MODES = ("baseline", "whole", "head")
AUX = [0, 1, 2]  # aux layer ids valid for any --layers >= 4 (they do not change what is loaded)
GB = 1e9


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def checkpoint_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, in the order real Llama checkpoints store them."""
    v, h = SHAPE["vocab_size"], SHAPE["hidden_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        shapes |= layer_shapes(i)
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(254)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(out)


def write_checkpoint(out: Path, layers: int, shard_gb: float, seed: int = 0) -> float:
    """Write the checkpoint shard by shard (one shard in memory at a time); returns its GB."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(num_hidden_layers=layers, architectures=["LlamaForCausalLM"], **SHAPE).save_pretrained(out)
    write_tokenizer(out)
    g = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, shape in checkpoint_shapes(layers).items():
        t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else torch.randn(shape, generator=g).mul_(0.02).bfloat16()
        if current and size + t.numel() * 2 > shard_gb * GB:
            shards.append(current)
            save_file(current, out / f"shard-{len(shards)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0
        current[name], size = t, size + t.numel() * 2
    shards.append(current)
    save_file(current, out / f"shard-{len(shards)}.safetensors", metadata={"format": "pt"})
    n = len(shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (out / f"shard-{k}.safetensors").rename(out / final)
        weight_map |= {name: final for name in shard}
        total += sum(t.numel() * 2 for t in shard.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total / GB


def proc_status() -> dict[str, float]:
    """VmHWM and VmRSS of this process, in GB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 / GB for k in ("VmHWM", "VmRSS")}


def tensors_of(held) -> list[torch.Tensor]:
    """The distinct weight tensors (by storage) a loaded target holds."""
    if held is None:
        return []
    found = (
        list(held[0].model.parameters()) + list(held[0].model.buffers())
        if isinstance(held, tuple)
        else [held.embed_weight, held.lm_head_weight]
    )
    return list({t.untyped_storage().data_ptr(): t for t in found}.values())


def touch(held: list[torch.Tensor]) -> None:
    """Read one value a page of every host tensor, as a trainer that uses them would: weights
    loaded lazily (memory-mapped safetensors) count in the resident set once read."""
    for t in held:
        if t.device.type == "cpu":
            flat = t.detach().reshape(-1)
            flat[:: max(1, 4096 // t.element_size())].float().sum()


def child(mode: str, path: Path, device: torch.device) -> dict:
    """Load the target as ``mode`` says, in this (fresh) process; the memory it took."""
    from models.target import HFTargetEngine, load_tokenizer
    from models.target_head import TargetHead

    if device.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=device)  # the CUDA context, in every row alike
        torch.cuda.reset_peak_memory_stats(device)
    before = proc_status()
    t0 = time.perf_counter()
    if mode == "whole":
        held = (HFTargetEngine.from_path(path, AUX, device=device, dtype=torch.bfloat16), load_tokenizer(path))
    elif mode == "head":
        held = TargetHead.from_path(path, AUX, device=device, dtype=torch.bfloat16)
    else:
        held = None
    seconds = time.perf_counter() - t0
    loaded = proc_status()
    held_tensors = tensors_of(held)
    touch(held_tensors)
    after = proc_status()
    row = {
        "mode": mode,
        "load_s": seconds,
        "tensor_gb": sum(t.untyped_storage().nbytes() for t in held_tensors) / GB,
        "host_peak_gb": after["VmHWM"],
        "host_rss_gb": after["VmRSS"],
        "host_rss_loaded_gb": loaded["VmRSS"],
        "host_rss_before_gb": before["VmRSS"],
    }
    if device.type == "cuda":
        row |= {"gpu_peak_gb": torch.cuda.max_memory_allocated(device) / GB, "gpu_held_gb": torch.cuda.memory_allocated(device) / GB}
    del held
    return row


def measure(path: Path, device: str) -> list[dict]:
    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--dir", str(path), "--device", device]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{mode}: the measuring process failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict]) -> str:
    gpu = "gpu_peak_gb" in rows[0]
    head = (
        f"{'mode':<9} {'weights GB':>10} {'host peak GB':>12} {'host RSS GB':>11}"
        + (f" {'GPU peak GB':>11} {'GPU held GB':>11}" if gpu else "")
        + f" {'load s':>7}"
    )
    lines = [head]
    for r in rows:
        g = f" {r['gpu_peak_gb']:>11.2f} {r['gpu_held_gb']:>11.2f}" if gpu else ""
        lines.append(f"{r['mode']:<9} {r['tensor_gb']:>10.2f} {r['host_peak_gb']:>12.2f} {r['host_rss_gb']:>11.2f}{g} {r['load_s']:>7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    hub.offline()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layers",
        type=int,
        default=32,
        choices=range(4, 129),
        metavar="{4..128}",
        help="decoder layers (32: Llama-3.1-8B; fewer keep the embedding and lm_head)",
    )
    p.add_argument("--shard-gb", type=float, default=5.0, help="safetensors shard size (real 8B checkpoints: ~5 GB)")
    p.add_argument("--device", default="cpu", help="where the trainer puts the target (cpu or cuda)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint dir: reused when it has an index, else written there")
    p.add_argument("--tmp", type=Path, default=None, help="parent of the temporary checkpoint dir (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    p.add_argument("--out", type=Path, default=None, help="write the rows and the shape here (JSON)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, torch.device(args.device))))
        return 0
    path = args.dir or Path(tempfile.mkdtemp(prefix="streamdraft-8b-", dir=args.tmp))
    try:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            ckpt_gb = json.loads(index.read_text())["metadata"]["total_size"] / GB
        else:
            t0 = time.perf_counter()
            ckpt_gb = write_checkpoint(path, args.layers, args.shard_gb)
            print(f"wrote {ckpt_gb:.2f} GB ({args.layers} layers) to {path} in {time.perf_counter() - t0:.0f} s")
        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        rows = measure(path, args.device)
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    print(f"Llama-3.1-8B widths, {layers} layers, {ckpt_gb:.2f} GB bf16 checkpoint, device {args.device}")
    print(table(rows))
    if args.out:
        args.out.write_text(
            json.dumps({"shape": SHAPE, "layers": layers, "checkpoint_gb": ckpt_gb, "device": args.device, "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
