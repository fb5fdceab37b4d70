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
    with_stack: bool = True  # (as SGLang's default)
    record_shapes: bool = False
    profile_prefix: str = ""
    profile_id: str = ""

    @classmethod
    def of(cls, given: dict[str, Any]) -> ProfileArgs:
        """The arguments, checked (ProfileRefused names what is wrong)."""
        try:
            args = cls(**{k: v for k, v in given.items() if v is not None})
        except TypeError as e:  # an argument this profile does not take
            raise ProfileRefused(str(e)) from None
        kinds = {
            "output_dir": str,
            "profile_prefix": str,
            "profile_id": str,
            "start_step": int,
            "num_steps": (int, type(None)),
            "with_stack": bool,
            "record_shapes": bool,
            "activities": (list, tuple),
        }
        for name, kind in kinds.items():
            value = getattr(args, name)
            counted = name in ("start_step", "num_steps")
            if not isinstance(value, kind) or (counted and isinstance(value, bool)):
                raise ProfileRefused(f"{name}: {value!r} is not of the right type")
        for name in ("output_dir", "profile_prefix", "profile_id"):
            bad = "\0/" if name != "output_dir" else "\0"  # names within output_dir
            if any(c in getattr(args, name) for c in bad):
                raise ProfileRefused(f"{name} must not hold {' or '.join(map(repr, bad))}")
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
        # the trace of the last profile that ended by itself (num_steps), or why it failed,
        # for the next stop to report
        self.ended: str | None = None
        self.failure: str | None = None

    @property
    def active(self) -> bool:
        return self.args is not None

    def start(self, given: dict[str, Any]) -> None:
        if self.args is not None:
            raise ProfileRefused("a profile is already running: /stop_profile first")
        args = ProfileArgs.of(given)
        self.ended = self.failure = None
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        if not os.access(args.output_dir, os.W_OK):
            raise ProfileRefused(f"output_dir: {args.output_dir} is not writable")
        self.args, self.steps = args, 0
        if args.start_step == 0:
            self._begin()

    def after_step(self) -> None:
        """Count a step: the profile begins after start_step of them, and ends by itself
        after num_steps (the trace kept for the next stop to report). Never raises: the
        scheduler goes on whatever the profiler meets (a full disk, a folder removed)."""
        if self.args is None:
            return
        self.steps += 1
        try:
            if self.profile is None:
                if self.steps >= self.args.start_step:
                    self._begin()
            elif self.args.num_steps is not None and self.steps >= self.args.num_steps:
                self.ended = self.stop()
        except Exception as e:
            logger.exception("the profile failed")
            self.args, self.profile = None, None
            self.failure = f"the profile failed: {e!r}"

    def stop(self) -> str | None:
        """End the profile and write its trace: the trace's path ('' if no step ran); for a
        profile that ended by itself since, what it left; None if there was none."""
        if self.args is None:
            failure, self.failure = self.failure, None
            if failure is not None:
                raise RuntimeError(failure)
            ended, self.ended = self.ended, None
            return ended
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
