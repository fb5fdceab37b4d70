"""Profiling the scheduler's steps with torch's profiler, started and stopped while the server
runs (SGLang's /start_profile and /stop_profile): from step `start_step` on (counted from
the start), for `num_steps` steps or until stopped, one Chrome trace per scheduler
(`<output_dir>/<profile_prefix><profile_id>-DP-<rank>.trace.json.gz`, opened in Perfetto
or chrome://tracing). Only the scheduler's process is traced (tensor-parallel ranks > 0 are
not)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names; GPU: CUDA's kernels where there are
PROFILER_DIR_ENVS = ("RADIXSERVE_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR")


class ProfileRefused(ValueError):
    """A start or stop that cannot be done (already profiling, not profiling, bad args)."""


def default_output_dir() -> str:
    for name in PROFILER_DIR_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return "/tmp"


@dataclass
class ProfileArgs:
    """What /start_profile asks for (SGLang's ProfileReqInput, the fields served here)."""

    output_dir: str = field(default_factory=default_output_dir)
    start_step: int = 0  # steps to let pass first (a warm-up)
    num_steps: int | None = None  # then stop by itself after this many; None: at stop
    activities: tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False
    profile_prefix: str = ""
    profile_id: str = ""

    @classmethod
    def of(cls, given: dict[str, Any]) -> ProfileArgs:
        args = cls(**{k: v for k, v in given.items() if v is not None})
        args.activities = tuple(args.activities)
        unknown = [a for a in args.activities if a not in ACTIVITIES]
        if unknown:
            raise ProfileRefused(f"activities: {unknown} are not among {list(ACTIVITIES)}")
        if args.start_step < 0 or (args.num_steps is not None and args.num_steps < 1):
            raise ProfileRefused("start_step must be >= 0 and num_steps >= 1")
        args.profile_id = args.profile_id or str(time.time())
        return args


class StepProfiler:
    """Holds at most one profile; the scheduler loop calls `after_step` after each step."""

    def __init__(self, dp_rank: int = 0) -> None:
        self.dp_rank = dp_rank
        self.args: ProfileArgs | None = None
        self.profile: torch.profiler.profile | None = None
        self.steps = 0  # since start: to start_step, then within the profile

    @property
    def active(self) -> bool:
        return self.args is not None

    def start(self, given: dict[str, Any]) -> None:
        if self.args is not None:
            raise ProfileRefused("a profile is already running: /stop_profile first")
        args = ProfileArgs.of(given)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        if not os.access(args.output_dir, os.W_OK):
            raise ProfileRefused(f"output_dir: {args.output_dir} is not writable")
        self.args, self.steps = args, 0
        if args.start_step == 0:
            self._begin()

    def after_step(self) -> str | None:
        """Count a step; the trace's path if the profile ended with it (num_steps)."""
        if self.args is None:
            return None
        self.steps += 1
        if self.profile is None:
            if self.steps >= self.args.start_step:
                self._begin()
            return None
        if self.args.num_steps is not None and self.steps >= self.args.num_steps:
            return self.stop()
        return None

    def stop(self) -> str:
        """End the profile and write its trace; the trace's path ('' if no step ran)."""
        if self.args is None:
            raise ProfileRefused("no profile is running: /start_profile first")
        args, profile = self.args, self.profile
        self.args, self.profile = None, None
        if profile is None:  # stopped before start_step came
            return ""
        profile.stop()
        name = f"{args.profile_prefix}{args.profile_id}-DP-{self.dp_rank}.trace.json.gz"
        path = str(Path(args.output_dir) / name)
        started = time.perf_counter()
        profile.export_chrome_trace(path)
        logger.info("profile written to %s in %.1fs", path, time.perf_counter() - started)
        return path

    def _begin(self) -> None:
        assert self.args is not None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if "GPU" in self.args.activities and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(
            activities=activities,
            record_shapes=self.args.record_shapes,
            with_stack=self.args.with_stack,
            profile_memory="MEM" in self.args.activities,
        )
        self.profile.start()
        self.steps = 0
