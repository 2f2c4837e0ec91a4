"""torch.profiler over some optimizer steps of a run (``trainer.profile_steps=[FIRST,LAST]``).

The traced steps are whole loop iterations: the wait for the target's features, labels, the TTT forward,
backward, the optimizer and every component after it. The run dir's ``profile/`` gets, from the main rank:

  kernels.txt   the operators and kernels by their own device time on a GPU, by their total time on a CPU; the
                ``labels`` / ``ttt_forward`` / ``backward`` / ``optimizer`` ranges of ``trainer.ttt`` among them
  trace.json    the Chrome trace (chrome://tracing, https://ui.perfetto.dev), with the Python frames of every
                operator: a host sync (cudaStreamSynchronize under aten::item, cudaDeviceSynchronize) shows the line
                that asked for it
  summary.json  wall time a step, and on a GPU the kernels' busy time a step and its share of the wall

A profiled run is slower over the traced steps; its throughput figures there are the profiler's, not the run's. On
the H200 (torch 2.11) a profiled run also stayed slower after LAST: a median of 0.146 s a step against 0.134 s in an
unprofiled run of the same recipe, both 0.133-0.138 s before FIRST (docs/device_runs/2026-12-03-h200-hass-profile/). Profile a run
whose later throughput is not a figure you need.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"  # under the run dir
TABLE_ROWS = 60  # operators and kernels kept in kernels.txt


class StepProfiler:
    """A trainer component: starts torch.profiler when step FIRST begins, stops when step LAST ends, writes its files."""

    def __init__(self, steps: list[int], state, device: torch.device, out_dir: Path, is_main: bool):
        self.first, self.last = steps
        self.state, self.device, self.out_dir, self.is_main = state, device, Path(out_dir), is_main
        self.prof: profile | None = None
        self.started_s = 0.0

    def after_step(self, at) -> None:
        step = self.state.step
        if step == self.first - 1 and self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, with_stack=True)
            self.prof.start()
            self.started_s = time.perf_counter()
        elif step == self.last and self.prof is not None:
            self.prof.stop()
            wall_s = time.perf_counter() - self.started_s
            if self.is_main:
                self.write(self.prof, wall_s)
            self.prof = None

    def write(self, prof: profile, wall_s: float) -> None:
        steps = self.last - self.first + 1
        on_gpu = self.device.type == "cuda"
        frames = {e.name for e in prof.events() if e.is_python_function}  # they stay in the trace, not in the table
        averages = EventList([a for a in prof.key_averages() if a.key not in frames], use_device="cuda" if on_gpu else None)
        key = "self_device_time_total" if on_gpu else "cpu_time_total"  # on a CPU the ranges' own time goes to their frames
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "kernels.txt").write_text(averages.table(sort_by=key, row_limit=TABLE_ROWS) + "\n")
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        summary = {"steps": [self.first, self.last], "wall_ms_per_step": 1e3 * wall_s / steps}
        if on_gpu:
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
            busy_us = sum(e.time_range.elapsed_us() for e in kernels)  # kernels and copies, not the ranges' GPU twins
            summary |= {"gpu_busy_ms_per_step": busy_us / 1e3 / steps, "gpu_busy_share": busy_us / 1e6 / wall_s}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        busy = f", the GPU's kernels busy {summary['gpu_busy_share']:.0%} of it" if on_gpu else ""
        log.info(f"profile of steps {self.first}-{self.last}: {summary['wall_ms_per_step']:.1f} ms a step{busy}; {self.out_dir}")
