"""Where the tuner's work runs: compile jobs and measurement batches.

An ``Executor`` compiles ``tuner.aot`` jobs and hands out measurers for a ``MeasurerSpec``. The driver
(``tuner.optimize``) runs the search, keeps the tuning database and builds the bundles whatever the
executor; only these two kinds of work move.

- ``LocalExecutor``: this process and its compile pool (``aot.compile_many``), the measurer built here.
- ``tuner.distributed.RayExecutor``: compile jobs as Ray CPU tasks, measurement batches as Ray GPU tasks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

from dietcode_ort.bench_report import cuda_device

if TYPE_CHECKING:  # tuner.aot imports triton: only the compiling paths load it
    from tuner.aot import CompileJob, CompileResult
    from tuner.measure import Measurer, MeasurerSpec

__all__ = ["Executor", "LocalExecutor", "cuda_capability"]


def cuda_capability(device: int = 0) -> tuple[int, int] | None:
    """The compute capability of CUDA device ``device`` as the driver reports it (``cuda_device``), or None
    without a driver or that device. The tuner's GPU timing needs only the driver (``tuner.gpu_timing``), not
    torch: a GPU counts as visible when the driver sees it, whether or not torch was built with CUDA."""
    found = cuda_device(device)
    return None if found is None else (found[1], found[2])


class Executor(ABC):
    """Runs compile jobs and measurement batches; see the module docstring."""

    #: whether the executor draws its own progress bar (the search then draws none)
    shows_progress: bool = False

    @abstractmethod
    def compile_many(self, jobs: Sequence[CompileJob]) -> list[CompileResult]:
        """One result per job, in job order; a failed compile is a result, not an exception."""

    @abstractmethod
    def measurer(self, spec: MeasurerSpec) -> Measurer:
        """A measurer whose batches run where this executor runs them."""

    @abstractmethod
    def gpu_available(self) -> bool:
        """Whether a "gpu" measurer can run (``--measure auto`` picks it then)."""

    def expect(self, measurements: int) -> None:
        """A hint for the progress display: about this many measurements are coming."""

    def searches(self) -> int:
        """How many workloads' searches may run at once (in threads) on this executor."""
        return 1

    def abort(self) -> None:
        """Stop the work of searches running in other threads (they raise); after an interrupt."""

    def close(self) -> None:
        """Release what the executor holds."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalExecutor(Executor):
    """This process: compile jobs in ``workers`` forked processes, measurers built and run here."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def compile_many(self, jobs: Sequence[CompileJob]) -> list[CompileResult]:
        from tuner import aot

        return aot.compile_many(list(jobs), workers=self.workers)

    def measurer(self, spec: MeasurerSpec) -> Measurer:
        return spec.build()

    def gpu_available(self) -> bool:
        """Whether the CUDA driver sees a GPU (``cuda_capability``); torch is not needed to time kernels."""
        return cuda_capability() is not None
