"""Watch and report the Kimi-shaped co-located run (lab/kimi_reduced_run.sh).

    python lab/kimi_reduced_report.py watch --pid PID --out OUT/watch.json   # until PID exits
    python lab/kimi_reduced_report.py report OUT [--peak-flops F]            # OUT/result.json
    python lab/kimi_reduced_report.py peak                                   # this GPU's bf16 matmul FLOP/s

``watch`` samples, every second, the process tree under ``--pid`` (the deepspeed launcher):
each process's ``/proc/<pid>/io`` counters and command line, ``nvidia-smi``'s GPU memory per
process and per GPU; it keeps each process's first and last counters, its write counter at each
change (``writes``: [seconds, bytes]) and every peak.

``report`` reads what the run left under OUT — ``plan.json`` (models.memory_plan),
``run/metrics.jsonl`` and ``run/summary.json`` (the trainer), ``measure/rank*.json``
(lab/train_measured.py), ``watch.json``, ``verify.txt`` and ``train.log`` — and writes
``result.json``: tokens/s, MFU, stall, peak GPU memory per rank against the plan, the aux
width, the export's verification, and the bytes the run sent to storage against what its
hidden states would have been.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: no install needed

from models.memory_plan import GB, TargetShape, handoff_bytes_per_token, transformers_config  # noqa: E402
from trainer.phases import START_EVAL, STARTUP  # noqa: E402

PEAK_FLOPS = 790e12  # bf16 dense matmul ceiling measured on the H200 (lab/bench_throughput.py)
AUX_LOG = "aux width check"  # the engine's line once its first batch passed check_aux_width, where it logs one


# --------------------------------------------------------------------------- watch


def process_tree(root: int) -> dict[int, int]:
    """``root`` and every process below it, each with its parent's pid."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:  # exited while listing
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root: parent.get(root, 0)}, [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        tree |= {p: parent[p] for p in frontier}
    return tree


def read_proc(pid: int) -> dict | None:
    """io counters and command line of ``pid``; None once it has exited."""
    try:
        io = {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return {"io": io, "cmd": cmd[:300]}


def nvidia_smi(query: str, kind: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    )
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie not yet reaped has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def watch(pid: int, out: Path, interval: float = 1.0) -> dict:
    procs: dict[int, dict] = {}
    gpu_peak: dict[str, int] = {}
    app_peak: dict[int, int] = {}
    has_smi = subprocess.run(["which", "nvidia-smi"], capture_output=True).returncode == 0
    start = time.time()
    result: dict = {}
    while running(pid):
        for p, ppid in process_tree(pid).items():
            seen = read_proc(p)
            if seen is not None:
                now = time.time() - start
                row = procs.setdefault(p, {"cmd": seen["cmd"], "ppid": ppid, "io_first": seen["io"], "first_s": now, "writes": []})
                row["io_last"], row["last_s"] = seen["io"], now
                if not row["writes"] or row["writes"][-1][1] != seen["io"]["write_bytes"]:
                    row["writes"].append([round(now, 2), seen["io"]["write_bytes"]])
        if has_smi:
            for index, used in nvidia_smi("index,memory.used", "gpu"):
                gpu_peak[index] = max(gpu_peak.get(index, 0), int(used))
            for app_pid, used in nvidia_smi("pid,used_memory", "compute-apps"):
                app_peak[int(app_pid)] = max(app_peak.get(int(app_pid), 0), int(used))
        result = {
            "root_pid": pid,
            "started_epoch": start,
            "seconds": time.time() - start,
            "processes": procs,
            "gpu_used_peak_mib": gpu_peak,
            "app_used_peak_mib": app_peak,
        }
        out.write_text(json.dumps(result, indent=1))
        time.sleep(interval)
    return result


# --------------------------------------------------------------------------- report


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def rows_of(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def moe_forward_flops(s: TargetShape, ctx: float) -> float:
    """FLOPs a token of the target's decoder body (no lm_head), with ``ctx`` keys on average:
    2 x the weights a token meets (attention, the dense MLP or top-k + shared experts and the
    router) + attention scores (QK^T over nope + rope, PV over v) of the MHA-form prefill."""
    from models.memory_plan import attention_params

    a = attention_params(s)
    attn = s.layers * (2 * (a["replicated"] + a["split"]) + 2 * s.heads * (s.nope + s.rope + s.v_head) * ctx)
    dense = s.dense_layers * 2 * 3 * s.hidden * s.intermediate
    moe = s.moe_layers * 2 * ((s.topk + s.shared_experts) * 3 * s.hidden * s.moe_intermediate + s.hidden * s.experts)
    return attn + dense + moe


def flops_per_token(
    config: dict, num_aux: int, draft_vocab_size: int, ctx: float, ttt: int, layout: str = "llama", fc_norm: bool = False
) -> dict[str, float]:
    """Target forward (``moe_forward_flops``) + labels + training of the draft of ``layout`` (trainer.flops'
    formula; its Llama target term is left out)."""
    from lab.bench_throughput import flops_per_token as bench_flops
    from models.draft import draft_shape_for

    s = TargetShape.from_config(config)
    tc = transformers_config(config)
    shape = draft_shape_for(tc, num_aux, draft_vocab_size, layout=layout, fc_norm=fc_norm)
    no_target = SimpleNamespace(  # the count's Llama target term is left out: no layers
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=0,
        head_dim=shape.head_dim,
        num_attention_heads=s.heads,
        num_key_value_heads=tc.num_key_value_heads,
        vocab_size=s.vocab,
    )
    rest = bench_flops(no_target, shape, max(1, round(2 * ctx - 1)), ttt)
    target = moe_forward_flops(s, ctx)
    return {"target_forward": target, "labels": rest["labels"], "draft_train": rest["draft_train"], "total": target + rest["total"]}


def throughput(rows: list[dict], ranks: int) -> dict:
    """tokens/s and stall of the logged windows after the first (the first holds warm-up and JIT)."""
    train = [r for r in rows if "perf/tokens_per_s" in r]
    steady = train[1:] or train
    if not steady:
        return {}
    steps = [r["step"] for r in train]
    seen = [r["train/tokens_seen"] for r in train]
    times = [r["perf/train_time_s"] for r in train]
    tok_s = (seen[-1] - seen[0]) / (times[-1] - times[0]) if len(train) > 1 else seen[0] / times[0]
    return {
        "tokens_per_s": tok_s,
        "tokens_per_s_windows": [r["perf/tokens_per_s"] for r in steady],
        "stall_share_mean": sum(r["perf/stall_share"] for r in steady) / len(steady),
        "step_time_s_mean": sum(r["perf/step_time_s"] for r in steady) / len(steady),
        "logged_steps": steps,
        "rank0_gpu_mem_gib": max(r.get("perf/gpu_mem_gb", 0.0) for r in train),
        "losses": [r.get("train/loss") for r in train],
        "ranks": ranks,
    }


def read_run_config(path: Path) -> dict:
    """The composed config Hydra saved for the run (aux ids, draft vocab, TTT steps)."""
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ValueError(f"{path}: missing; the trainer did not start (see train.log)")
    return OmegaConf.to_container(OmegaConf.load(path))


def run_files_bytes(run: Path) -> int:
    return sum(f.stat().st_size for f in run.rglob("*") if f.is_file()) if run.is_dir() else 0


def own_write_bytes(procs: dict[str, dict]) -> dict[str, int]:
    """Each watched process's own bytes to storage: the growth of its write counter less the counters of the children
    it reaped while watched, which Linux adds into a parent's (a launcher's counter holds its trainer's writes)."""
    own = {pid: p["io_last"]["write_bytes"] - p["io_first"]["write_bytes"] for pid, p in procs.items()}
    for p in procs.values():
        parent = procs.get(str(p["ppid"]))
        if parent is not None and p["last_s"] < parent["last_s"]:  # gone before its parent's last look: reaped into it
            own[str(p["ppid"])] -= p["io_last"]["write_bytes"]
    return {pid: max(0, b) for pid, b in own.items()}


def program_bytes(procs: dict[str, dict], own: dict[str, int]) -> dict[str, int]:
    """Each program's bytes to storage (``own_write_bytes``, summed by the name of its executable): the trainer
    and the engine (python3) apart from the kernel builds (nvcc, cicc, ninja, ...) a bare host runs."""
    by: dict[str, int] = {}
    for pid, p in procs.items():
        name = "torch inductor compile worker" if "compile_worker" in p["cmd"] else Path(p["cmd"].split(" ")[0]).name
        by[name] = by.get(name, 0) + own[pid]
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


def counter_at(writes: list[list[float]], t: float) -> int:
    """A write counter sampled at each change as [seconds, bytes], at ``t``: its first value before it was seen."""
    value = writes[0][1]
    for at, b in writes:
        if at > t:
            break
        value = b
    return int(value)


def training_window(rank: dict, summary: dict, watched: dict) -> tuple[float, float]:
    """The seconds of rank 0's training steps on the watcher's clock: its process start plus its start-up and
    start-of-run eval, for as long as its steps took. Its checkpoint and exports come after the last step."""
    phases = summary["phase_s"]
    begin = rank["created_epoch"] - watched["started_epoch"] + phases[STARTUP] + phases[START_EVAL]
    return begin, begin + summary["train_time_s"]


def while_training(ranks: list[dict], summary: dict | None, watched: dict | None, tokens: int, handoff: int) -> dict | None:
    """What every watched process sent to storage during the training steps, a token: hidden states on disk would be
    ``handoff`` bytes a token (the checkpoints of ``trainer.checkpoint_every`` count too)."""
    rank0 = next((r for r in ranks if r["rank"] == 0), None)
    if not (rank0 and summary and watched and tokens) or "created_epoch" not in rank0 or "started_epoch" not in watched:
        return None
    a, b = training_window(rank0, summary, watched)
    written = sum(counter_at(p["writes"], b) - counter_at(p["writes"], a) for p in watched["processes"].values())
    return {"window_s": [a, b], "bytes": written, "bytes_per_token": written / tokens, "hidden_state_bytes_per_token": handoff}


def disk_report(out: Path, ranks: list[dict], watched: dict | None, tokens: int, handoff: int, summary: dict | None) -> dict:
    """Bytes the processes under the launcher sent to storage, each counted once (``own_write_bytes``; the trainer
    ranks' own measure where nothing was watched) and by program, the files the run dir holds, what the hidden states
    of the trained tokens would have been, and what was written while the steps ran (``while_training``): no hidden
    state on disk when that is under 1 % of the hidden states' bytes a token."""
    rank_bytes = sum(r["io_end"]["write_bytes"] - r["io_start"]["write_bytes"] for r in ranks)
    processes, by_program = {}, {}
    if watched is not None:
        if any("ppid" not in p for p in watched["processes"].values()):
            raise ValueError(f"{out / 'watch.json'}: no parent pids (an older watcher's): its writes cannot be counted once")
        own = own_write_bytes(watched["processes"])
        processes = {pid: {"cmd": p["cmd"], "write_bytes": own[pid]} for pid, p in watched["processes"].items()}
        by_program = program_bytes(watched["processes"], own)
    written = sum(p["write_bytes"] for p in processes.values()) if processes else rank_bytes
    files = run_files_bytes(out / "run")
    training = while_training(ranks, summary, watched, tokens, handoff)
    return {
        "trainer_ranks_write_bytes": rank_bytes,
        "processes": processes,
        "by_program": by_program,
        "written_bytes": written,
        "run_dir_file_bytes": files,
        "written_beyond_run_files": max(0, written - files),
        "hidden_state_bytes_if_on_disk": tokens * handoff,
        "while_training": training,
        "no_hidden_states_on_disk": None if training is None else training["bytes_per_token"] < 0.01 * handoff,
    }


def memory_report(plan: dict | None, ranks: list[dict], watched: dict | None) -> dict:
    out: dict = {
        "per_rank": [{k: r.get(k) for k in ("rank", "pid", "device", "max_memory_allocated", "max_memory_reserved")} for r in ranks]
    }
    if watched is not None:
        out["nvidia_smi_gpu_used_peak_gb"] = {i: mib * 2**20 / GB for i, mib in watched["gpu_used_peak_mib"].items()}
        names = {int(p): v["cmd"] for p, v in watched["processes"].items()}
        out["nvidia_smi_process_peak_gb"] = {
            str(p): {"gb": mib * 2**20 / GB, "cmd": names.get(int(p), "not under the launcher (or another pid namespace)")}
            for p, mib in watched["app_used_peak_mib"].items()
        }
    if plan is not None:
        out["predicted_gb"] = {
            "engine": plan["engine_bytes"] / GB,
            "trainer": plan["trainer_bytes"] / GB,
            "per_gpu": plan["per_gpu_bytes"] / GB,
        }
    return out


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """The GPU's bf16 dense matmul rate, FLOP/s: the best of ``reps`` timed [n, n] x [n, n] products."""
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n**3 / best


def report(out: Path, peak_flops: float = PEAK_FLOPS) -> dict:
    plan, summary = read_json(out / "plan.json"), read_json(out / "run" / "summary.json")
    config = json.loads((out / "target" / "config.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted((out / "measure").glob("rank*.json"))]
    watched = read_json(out / "watch.json")
    rows = rows_of(out / "run" / "metrics.jsonl")
    run_cfg = read_run_config(out / "run" / ".hydra" / "config.yaml")
    draft = run_cfg["draft"]
    num_aux, draft_vocab_size, ttt = len(run_cfg["target"]["aux_layer_ids"]), draft["draft_vocab_size"], draft["ttt_steps"]
    data = (summary or {}).get("data", {})
    ctx = (data["tokens"] / data["samples"] + 1) / 2 if data.get("samples") else 1.0
    flops = flops_per_token(config, num_aux, draft_vocab_size, ctx, ttt, draft["layout"], draft["fc_norm"])
    perf = throughput(rows, max(1, len(ranks)))
    if perf:
        perf["mfu"] = perf["tokens_per_s"] * flops["total"] / (perf["ranks"] * peak_flops)
    log = (out / "train.log").read_text(errors="replace") if (out / "train.log").is_file() else ""
    aux_lines = [line for line in log.splitlines() if AUX_LOG in line]
    tokens = int((summary or {}).get("tokens_seen", 0))
    handoff = handoff_bytes_per_token(TargetShape.from_config(config), num_aux)
    verify = (out / "verify.txt").read_text() if (out / "verify.txt").is_file() else None
    result = {
        "finished": summary is not None,
        "steps": (summary or {}).get("steps"),
        "stopped_by": (summary or {}).get("stopped_by"),
        "tokens_seen": tokens,
        "train_time_s": (summary or {}).get("train_time_s"),
        "wall_time_s": (summary or {}).get("wall_time_s"),
        "throughput": perf,
        "flops_per_token": flops,
        "flops_mean_doc_ctx": ctx,
        "peak_flops_per_gpu": peak_flops,
        "aux_width": {
            "expected": plan["facts"]["aux_width"],
            "engine_log_lines": aux_lines[:4],
            "how": "models/backends/sglang/target.py check_aux_width raises on any batch whose SGLang output is not "
            f"{num_aux} x {config.get('text_config', config)['hidden_size']} wide; "
            "the ring slots (trainer/stream/engine_process.py RingSpec) are that wide",
        },
        "memory": memory_report(plan, ranks, watched),
        "disk": disk_report(out, ranks, watched, tokens, handoff, summary),
        "export_verify": {
            "rc": int((out / "verify.rc").read_text()) if (out / "verify.rc").is_file() else None,
            "output": verify,
            "trainer_verify": (summary or {}).get("verify"),
        },
        "eval": (summary or {}).get("eval"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def print_result(r: dict) -> None:
    perf = r["throughput"]
    print(f"finished: {r['finished']}  steps: {r['steps']} ({r['stopped_by']})  tokens: {r['tokens_seen']}")
    if perf:
        print(
            f"tokens/s {perf['tokens_per_s']:.0f}  MFU {100 * perf['mfu']:.1f}%  stall {100 * perf['stall_share_mean']:.1f}%  "
            f"step {perf['step_time_s_mean']:.2f} s  (FLOPs/token {r['flops_per_token']['total'] / 1e9:.1f} G)"
        )
    for row in r["memory"]["per_rank"]:
        if row.get("max_memory_allocated") is not None:
            print(
                f"rank {row['rank']}: trainer peak allocated {row['max_memory_allocated'] / GB:.1f} GB, "
                f"reserved {row['max_memory_reserved'] / GB:.1f} GB"
            )
    for gpu, gb in r["memory"].get("nvidia_smi_gpu_used_peak_gb", {}).items():
        print(f"GPU {gpu}: nvidia-smi peak used {gb:.1f} GB (trainer + engine)")
    if "predicted_gb" in r["memory"]:
        print(
            f"predicted per GPU: engine {r['memory']['predicted_gb']['engine']:.1f} GB "
            f"+ trainer {r['memory']['predicted_gb']['trainer']:.1f} GB"
        )
    d = r["disk"]
    programs = ", ".join(f"{name} {b / GB:.2f}" for name, b in list(d["by_program"].items())[:4])
    print(
        f"disk: {d['written_bytes'] / GB:.2f} GB written ({programs}), {d['run_dir_file_bytes'] / GB:.2f} GB of run files; "
        f"hidden states would be {d['hidden_state_bytes_if_on_disk'] / GB:.1f} GB"
    )
    if (w := d["while_training"]) is None:
        print("while training: not measured (no watch.json series, rank0.json start time or trained tokens)")
    else:
        print(
            f"while training: {w['bytes'] / 1e6:.1f} MB written, {w['bytes_per_token']:.0f} B a token against the hidden states' "
            f"{w['hidden_state_bytes_per_token']} B; none on disk: {d['no_hidden_states_on_disk']}"
        )
    print(
        f"aux width {r['aux_width']['expected']}; engine log lines: {len(r['aux_width']['engine_log_lines'])}; "
        f"export verify rc {r['export_verify']['rc']}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("out", type=Path)
    r.add_argument("--peak-flops", type=float, default=PEAK_FLOPS, help="the GPU's bf16 matmul ceiling, FLOP/s (`peak` measures it)")
    sub.add_parser("peak", help="print this GPU's bf16 matmul ceiling, FLOP/s")
    a = p.parse_args(argv)
    if a.cmd == "watch":
        watch(a.pid, a.out)
    elif a.cmd == "peak":
        print(f"{matmul_peak():.4g}")
    else:
        print_result(report(a.out, a.peak_flops))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
