"""Online EAGLE-3 training throughput on one GPU: inprocess vs colocated vs an offline baseline.

    python3 lab/bench_throughput.py --out bench.json              # H200: ~3 minutes
    python3 lab/bench_throughput.py --profile --out profile.json  # draft step: top ops + kernel variants
    python3 lab/bench_throughput.py --tiny --out /tmp/bench.json  # CPU smoke run, seconds
    python3 lab/bench_throughput.py --modes colocated,sglang --out sglang.json  # transformers vs SGLang engine
    python3 lab/bench_throughput.py --modes colocated --pointwise eager,compiled --out pw.json  # before/after, one run

Needs torch, transformers, numpy and hydra-core (``trainer.config``), not DeepSpeed or wandb: the draft
(``models.draft``), its TTT objective (``trainer.ttt``) and a torch AdamW are built
directly. The target (``--target``) is Llama-3.1-8B-shaped (the default) or SmolLM2-135M-shaped
(the embedded target, the ``h200_quality`` recipe's) with seeded random bf16 weights (sdpa); every
mode reads the same token batches (``--rows`` x ``--seq``) and trains a draft from the same
seed, so features and losses can be compared across modes.

Modes:
- ``inprocess``: the trainer runs the target itself, then the draft step (``feature_stream``);
- ``colocated``: an engine process on the same GPU fills a ring of CUDA-IPC slots
  (``open_feature_stream``, ``engine.mode=colocated``);
- ``offline``: pass 1 runs the target and writes every batch's features to ``--disk-dir``
  (torch.save, fsync, then evicted from the page cache), pass 2 reads them back (one
  reader thread, two batches ahead) and trains. Its tokens/s counts both passes.
- ``sglang``: colocated with the target in SGLang (``engine=sglang``): a ModelRunner with
  random weights of the same shapes (``load_format=dummy``, a config.json in a temporary
  dir). Its weights are not the other modes', so it is left out of the feature comparison.
  Skipped (and said so) without a CUDA GPU or without SGLang installed.

Per mode: tokens/s; MFU = FLOPs/token (``trainer.flops.flops_per_token``: target forward + labels + draft
training) x tokens/s / 790 TFLOP/s; trainer stall = the share of step time spent in
``next(stream)`` plus the GPU wait for the features (timed as ``trainer/loop.py`` does, with
a synchronize after each); hand-off cost; peak GPU memory (trainer, engine, device);
bytes written to disk per token (/proc/<pid>/io ``write_bytes`` of trainer and engine,
plus the feature files of the offline mode).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

import torch  # noqa: E402

from models import hub  # noqa: E402
from models.backends.hf.target import RandomTarget  # noqa: E402
from models.backends.sglang.target import SGLangTarget  # noqa: E402
from models.batch import FeatureBatch, TokenBatch  # noqa: E402
from models.draft import DraftShape, Eagle3Draft, Pointwise, draft_shape_for  # noqa: E402
from models.engines import TargetFactory  # noqa: E402
from trainer.config import ScheduleConfig  # noqa: E402
from trainer.dist import free_port  # noqa: E402
from trainer.flops import H200_BF16_PEAK_TFLOPS, flops_per_token  # noqa: E402
from trainer.schedule import draft_optimizer  # noqa: E402
from trainer.stream.feature_stream import TargetSource, open_feature_stream  # noqa: E402
from trainer.ttt import TargetLabeler, TTTObjective, draft_step  # noqa: E402

PEAK_FLOPS = H200_BF16_PEAK_TFLOPS * 1e12
MODES = ("inprocess", "colocated", "offline", "sglang")
POINTWISE = ("eager", "compiled")  # models.draft.Pointwise

LLAMA_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
SMOLLM2_135M = dict(  # SmolLM2-135M-Instruct's config.json, the embedded target
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TARGETS = {"llama-8b": LLAMA_8B, "smollm2-135m": SMOLLM2_135M}
TINY = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


@dataclass
class BenchEngine:
    """The EngineConfig fields a stream reads (trainer.config needs Hydra; this does not)."""

    mode: str
    slots: int
    slot_tokens: int
    start_timeout_s: float = 900.0
    wait_timeout_s: float = 600.0


# --------------------------------------------------------------------------- set-up


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    target_cfg: dict
    factory: RandomTarget
    batches: list[TokenBatch]
    shape: DraftShape
    labeler: TargetLabeler  # the frozen target head the trainer keeps for the labels, and the vocab map
    flops: dict[str, float]
    pointwise: Pointwise  # eager here; main runs each mode with each --pointwise choice, --profile's variants swap the functions


def make_setup(args: argparse.Namespace) -> Setup:
    from transformers import AutoConfig

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target_cfg = dict(TINY if args.tiny else TARGETS[args.target])
    fields = {k: v for k, v in target_cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(target_cfg["model_type"], **fields)
    shape = draft_shape_for(config, 3, args.draft_vocab_size)
    g = torch.Generator().manual_seed(1)
    vocab = target_cfg["vocab_size"]
    batches = []
    prompt = max(1, args.seq // 10)
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.rows, args.seq), generator=g)  # [B, T]
        mask = torch.ones(args.rows, args.seq, dtype=torch.bool)
        mask[:, :prompt] = False  # a prompt without loss, then the answer
        batches.append(TokenBatch(ids, mask, torch.full((args.rows,), args.seq, dtype=torch.long)))
    draft_ids = torch.sort(torch.randperm(vocab, generator=g)[: shape.draft_vocab_size]).values.to(device)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=device)
    t2d[draft_ids] = True
    torch.manual_seed(2)
    lm_head = (torch.randn(vocab, target_cfg["hidden_size"], device=device) * 0.02).to(dtype)
    return Setup(
        args=args,
        device=device,
        dtype=dtype,
        target_cfg=target_cfg,
        factory=RandomTarget(target_cfg, seed=0, dtype=dtype, attn_implementation="sdpa"),
        batches=batches,
        shape=shape,
        labeler=TargetLabeler(lm_head, draft_ids, t2d),
        flops=flops_per_token(config, shape, args.seq, args.ttt),
        pointwise=Pointwise(),
    )


def make_objective(st: Setup) -> tuple[TTTObjective, torch.optim.Optimizer]:
    """A fresh draft objective (its pointwise chains as ``st.pointwise``) and its AdamW."""
    torch.manual_seed(3)
    with torch.device(st.device):
        draft = Eagle3Draft(st.shape, st.pointwise)
    draft.to(st.dtype)
    objective = TTTObjective(draft, st.args.ttt, 0.8, False)
    params = [p for p in objective.parameters() if p.requires_grad]
    return objective, draft_optimizer(params, ScheduleConfig(lr=1e-4), st.device)  # the trainer's AdamW


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def written_bytes(pid: int) -> tuple[int, int] | None:
    """(write_bytes, wchar) of a process: bytes it sent to storage, bytes it passed to write().
    None where /proc/<pid>/io cannot be read (the report then says n/a)."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError as err:
        print(f"note: cannot read /proc/{pid}/io ({err}); disk bytes are not measured", flush=True)
        return None
    values = dict(line.split(": ") for line in text.splitlines())
    return int(values["write_bytes"]), int(values["wchar"])


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (tmpfs means the "disk" is RAM)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def io_delta(before: list, after: list, field: int, tokens: int) -> float | None:
    """Bytes per token written (field 0: to storage; 1: through write()) between two snapshots of processes."""
    if any(x is None for x in before + after):
        return None
    return sum(a[field] - b[field] for a, b in zip(after, before)) / tokens


# --------------------------------------------------------------------------- the training side


@dataclass
class Run:
    """What one mode measured."""

    step_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)  # next(stream) + GPU wait, per measured step
    next_s: list[float] = field(default_factory=list)  # next(stream) alone (host), per measured step
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    checksums: list[list[float]] = field(default_factory=list)  # per batch: [sum aux, sum final] (fp32 sums)


def train(st: Setup, stream, objective: TTTObjective, opt: torch.optim.Optimizer) -> Run:
    """Consume ``stream`` like trainer/loop.py: next, synchronize, step, synchronize."""
    run, losses, sums = Run(), [], []
    for i in range(len(st.batches)):
        t0 = time.perf_counter()
        fb = next(stream)
        t_next = time.perf_counter()
        sync(st.device)
        t1 = time.perf_counter()
        sums.append(torch.stack([fb.aux.sum(dtype=torch.float32), fb.final.sum(dtype=torch.float32)]))
        out = draft_step(objective, st.labeler, fb, opt)
        losses.append(out.loss.detach())
        sync(st.device)
        t2 = time.perf_counter()
        if i >= st.args.warmup:
            run.step_s.append(t2 - t0)
            run.wait_s.append(t1 - t0)
            run.next_s.append(t_next - t0)
            run.tokens += fb.aux.shape[0] * fb.aux.shape[1]
    run.losses = [float(x) for x in losses]
    run.checksums = torch.stack(sums).tolist()
    return run


def summarize(st: Setup, run: Run, mode: str, extra_time_s: float = 0.0, **more) -> dict:
    wall = sum(run.step_s) + extra_time_s
    tok_s = run.tokens / wall
    row = {
        "mode": mode,
        "tokens_per_s": tok_s,
        "mfu": tok_s * st.flops["total"] / PEAK_FLOPS,
        "step_s_median": statistics.median(run.step_s),
        "stall_fraction": sum(run.wait_s) / sum(run.step_s),
        "measured_tokens": run.tokens,
        "losses": run.losses,
        "checksums": run.checksums,
        "trainer_peak_gpu_bytes": torch.cuda.max_memory_allocated(st.device) if st.device.type == "cuda" else None,
        "device_used_gpu_bytes": device_used(st.device),
    }
    row.update(more)
    return row


def device_used(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# --------------------------------------------------------------------------- modes


def run_inprocess(st: Setup) -> dict:
    engine = st.factory.build(st.device)
    objective, opt = make_objective(st)
    before = [written_bytes(os.getpid())]
    source = TargetSource(st.factory, engine=engine)
    with open_feature_stream(BenchEngine("inprocess", 2, 1), source, st.batches, st.device) as stream:
        run = train(st, stream, objective, opt)
    after = [written_bytes(os.getpid())]
    row = summarize(st, run, "inprocess", handoff_ms_per_batch=0.0, disk_bytes_per_token=io_delta(before, after, 0, run.tokens))
    del engine, source, objective, opt
    return row


def run_colocated(st: Setup, factory: TargetFactory | None = None, mode: str = "colocated") -> dict:
    objective, opt = make_objective(st)
    cfg = BenchEngine("colocated", st.args.slots, st.args.rows * st.args.seq)
    with TargetSource(factory or st.factory) as source:
        process = source.colocated(cfg, st.device)  # start (and build the target) outside the timed steps
        pids = [os.getpid(), process.pid]
        before = [written_bytes(p) for p in pids]
        with open_feature_stream(cfg, source, st.batches, st.device) as stream:
            run = train(st, stream, objective, opt)
            stream_stats = stream.stats
        after = [written_bytes(p) for p in pids]
        engine = process.stats()
        device_peak = device_used(st.device)
    copy_ms = 1000 * engine.copy_s / max(engine.batches, 1)
    receive_ms = 1000 * min(run.next_s)  # next() when the batch is already waiting: release + message + views
    row = summarize(
        st,
        run,
        mode,
        handoff_ms_per_batch=copy_ms + receive_ms,
        handoff_copy_ms=copy_ms,
        handoff_receive_ms=receive_ms,
        engine_lead_ms=1000 * stream_stats.message_latency_s / max(stream_stats.batches, 1),
        engine_peak_gpu_bytes=engine.peak_memory_bytes if st.device.type == "cuda" else None,
        engine_full_waits=engine.full_waits,
        engine_full_wait_s=engine.full_wait_s,
        disk_bytes_per_token=io_delta(before, after, 0, run.tokens),
        pipe_bytes_per_token=io_delta(before, after, 1, run.tokens),
    )
    row["device_used_gpu_bytes"] = device_peak
    del objective, opt
    return row


def sglang_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (pip install 'streamdraft[sglang]')"
    return None


def run_sglang(st: Setup) -> dict:
    """``run_colocated`` with the target in SGLang: the same shapes as config.json, random weights."""
    from transformers import AutoConfig

    fields = {k: v for k, v in st.target_cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(st.target_cfg["model_type"], architectures=["LlamaForCausalLM"], **fields)  # TARGETS, TINY
    with tempfile.TemporaryDirectory(prefix="streamdraft-sglang-target-") as path:
        config.save_pretrained(path)
        factory = SGLangTarget(
            path=path, dtype=st.dtype, mem_fraction_static=st.args.sglang_mem_fraction, load_format="dummy", dist_port=free_port()
        )
        return run_colocated(st, factory, "sglang")


class DiskStream:
    """Offline pass 2: one reader thread loads the saved batches two ahead; next() moves one to the GPU."""

    def __init__(self, paths: list[Path], device: torch.device):
        self.device, self.read_s = device, 0.0
        self._q: queue.Queue = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._read, args=(paths,), daemon=True)
        self._thread.start()

    def _read(self, paths: list[Path]) -> None:
        try:
            for path in paths:
                t0 = time.perf_counter()
                obj = torch.load(path, map_location="cpu")
                self.read_s += time.perf_counter() - t0
                self._q.put(obj)
        except BaseException as err:  # handed to the trainer thread, which raises it
            self._q.put(err)

    def __next__(self) -> FeatureBatch:
        obj = self._q.get()
        if isinstance(obj, BaseException):
            raise RuntimeError("the offline reader thread failed") from obj
        d = {k: v.to(self.device) for k, v in obj.items()}
        return FeatureBatch(TokenBatch(d["input_ids"], d["loss_mask"], d["lengths"]), d["aux"], d["final"])


def run_offline(st: Setup) -> dict:
    if fs_type(st.args.disk_dir) == "tmpfs":
        print(
            f"note: --disk-dir {st.args.disk_dir} is tmpfs (RAM): the offline baseline touches no disk; pass a dir on local storage",
            flush=True,
        )
    out_dir = Path(st.args.disk_dir) / f"streamdraft-offline-{os.getpid()}"
    out_dir.mkdir(parents=True, exist_ok=False)
    engine = st.factory.build(st.device)
    before = [written_bytes(os.getpid())]
    paths, gen_s, write_s = [], [], []
    for i, tokens in enumerate(st.batches):  # pass 1: features to disk
        t0 = time.perf_counter()
        fb = engine.features(tokens.to(st.device))
        sync(st.device)
        t1 = time.perf_counter()
        obj = {
            "aux": fb.aux.cpu(),
            "final": fb.final.cpu(),
            "input_ids": fb.tokens.input_ids.cpu(),
            "loss_mask": fb.tokens.loss_mask.cpu(),
            "lengths": fb.tokens.lengths.cpu(),
        }
        path = out_dir / f"batch{i:05d}.pt"
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # pass 2 reads the disk, not the page cache
        gen_s.append(time.perf_counter() - t0)
        write_s.append(time.perf_counter() - t1)
        paths.append(path)
    after = [written_bytes(os.getpid())]
    file_bytes = sum(p.stat().st_size for p in paths)
    del engine, fb, obj
    free_memory(st.device)
    objective, opt = make_objective(st)
    disk = DiskStream(paths, st.device)
    run = train(st, disk, objective, opt)
    for p in paths:
        p.unlink()
    out_dir.rmdir()
    tokens_all = sum(b.input_ids.numel() for b in st.batches)
    gen_measured = sum(gen_s[st.args.warmup :])
    row = summarize(
        st,
        run,
        "offline",
        extra_time_s=gen_measured,
        train_only_tokens_per_s=run.tokens / sum(run.step_s),
        generate_tokens_per_s=run.tokens / gen_measured,
        handoff_ms_per_batch=1000 * (sum(write_s) + disk.read_s) / len(paths),
        handoff_write_ms=1000 * sum(write_s) / len(paths),
        handoff_read_ms=1000 * disk.read_s / len(paths),
        disk_bytes_per_token=io_delta(before, after, 0, tokens_all),
        feature_file_bytes_per_token=file_bytes / tokens_all,
        disk_dir=str(out_dir.parent),
        disk_dir_fstype=fs_type(str(out_dir.parent)),
    )
    del objective, opt
    return row


# --------------------------------------------------------------------------- report


def table(rows: list[dict], flops: dict[str, float]) -> str:
    gb = lambda x: "-" if x is None else f"{x / 2**30:.1f}"  # noqa: E731
    na = lambda x, fmt: "n/a" if x is None else format(x, fmt)  # noqa: E731
    head = (
        f"{'mode':<18} {'tok/s':>9} {'MFU':>6} {'stall':>6} {'step s':>7} {'handoff ms':>10} {'disk B/tok':>10} "
        f"{'GPU GB trainer/engine/device':>28}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{gb(r['trainer_peak_gpu_bytes'])}/{gb(r.get('engine_peak_gpu_bytes'))}/{gb(r['device_used_gpu_bytes'])}"
        lines.append(
            f"{r['name']:<18} {r['tokens_per_s']:>9.0f} {100 * r['mfu']:>5.1f}% {100 * r['stall_fraction']:>5.1f}% "
            f"{r['step_s_median']:>7.3f} {r['handoff_ms_per_batch']:>10.2f} {na(r['disk_bytes_per_token'], '>10.0f')} {mem:>28}"
        )
    lines.append(
        f"FLOPs/token: {flops['total'] / 1e9:.2f} G = target forward {flops['target_forward'] / 1e9:.2f} G + labels "
        f"{flops['labels'] / 1e9:.2f} G + draft training {flops['draft_train'] / 1e9:.2f} G; MFU against {PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    )
    return "\n".join(lines)


def compare(rows: list[dict]) -> dict:
    """Features (checksums) and losses of every row (by name) against the first one's (sglang mode left out)."""
    rows = [r for r in rows if r["mode"] != "sglang"]  # SGLang's own random weights: other features, other losses
    ref = rows[0] if rows else None
    out = {}
    for r in rows[1:]:
        out[r["name"]] = {
            "features_equal": r["checksums"] == ref["checksums"],
            "max_checksum_diff": max(abs(a - b) for x, y in zip(r["checksums"], ref["checksums"]) for a, b in zip(x, y)),
            "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
        }
    return out


def default_pointwise(device: str) -> str:
    """The trainer's choice (``draft.compile_pointwise`` null) on ``device``."""
    return "compiled" if Pointwise.default_for(torch.device(device)).compiled else "eager"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test of this script)")
    p.add_argument("--profile", action="store_true", help="profile the draft step and time kernel variants instead")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument(
        "--pointwise",
        default=None,
        help=f"comma list of {POINTWISE}: the draft's pointwise chains, each mode run "
        "with each (default: the trainer's choice for the device)",
    )
    p.add_argument("--target", default="llama-8b", choices=list(TARGETS), help="the target's shapes (random weights)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--rows", type=int, default=None, help="sequences per batch (default 4; tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default 32000; tiny 128")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 3; tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 10; tiny 3)")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--disk-dir", default="/tmp", help="offline mode: where the features go")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.3, help="sglang mode: engine.sglang.mem_fraction_static")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.rows = args.rows or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.draft_vocab_size = args.draft_vocab_size or (128 if args.tiny else 32000)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.steps = args.steps or (3 if args.tiny else 10)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad or modes}; choose from {MODES}")
    args.modes = modes
    args.pointwise = [c for c in (args.pointwise or "").split(",") if c] or [default_pointwise(args.device)]
    if bad := [c for c in args.pointwise if c not in POINTWISE]:
        raise ValueError(f"--pointwise: unknown {bad}; choose from {POINTWISE}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device: run with --tiny (CPU) or on the GPU machine")
    return args


def main(argv: list[str] | None = None) -> dict:
    hub.offline()
    args = parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: threads only contend (the engine process takes the same count)
    st = make_setup(args)
    if args.profile:
        from lab.bench_profile import profile

        report = profile(st, make_objective)
    else:
        runners = {"inprocess": run_inprocess, "colocated": run_colocated, "offline": run_offline, "sglang": run_sglang}
        rows, skipped = [], {}
        if "sglang" in args.modes and (why := sglang_skip_reason(st.device)) is not None:
            print(f"sglang: skipped ({why})", flush=True)
            skipped["sglang"] = why
        for pw in args.pointwise:  # each mode with each pointwise choice: before and after in one run
            variant = replace(st, pointwise=Pointwise(compiled=pw == "compiled"))
            for mode in [m for m in args.modes if m not in skipped]:
                free_memory(st.device)
                t0 = time.perf_counter()
                rows.append(runners[mode](variant))
                name = mode if len(args.pointwise) == 1 else f"{mode}+{pw}"
                rows[-1] |= {"name": name, "pointwise": pw, "mode_wall_s": time.perf_counter() - t0}
                print(f"{name}: {rows[-1]['tokens_per_s']:.0f} tokens/s ({rows[-1]['mode_wall_s']:.0f} s)", flush=True)
        print(table(rows, st.flops))
        report = {"rows": rows, "skipped": skipped, "equivalence": compare(rows) if len(rows) > 1 else {}}
        print(json.dumps(report["equivalence"], indent=1))
    report.update(
        {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
            "args": vars(args),
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(st.device) if st.device.type == "cuda" else "cpu",
            "target_config": st.target_cfg,
            "draft_shape": st.shape.to_dict(),
            "flops_per_token": st.flops,
            "peak_flops": PEAK_FLOPS,
            "pointwise": args.pointwise,
        }
    )
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
