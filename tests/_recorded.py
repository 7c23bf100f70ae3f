"""The measurement table recorded on an NVIDIA H100 80GB HBM3 (benchmarks/record_table.py, committed under
benchmarks/results): the replay tests' data, and its rows read with csv and gzip alone, apart from the code
under test (tuner.measure.ReplayMeasurer, benchmarks/report_table.py)."""
from __future__ import annotations

import csv
import functools
import gzip
from pathlib import Path

H100_TABLE = (Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3" / "device-run"
              / "stage2" / "table.csv.gz")
H100_ROWS = 60672  # 5 sets x 128 instances x (their configs + the vendor)
REFUSAL = "the runtime would not launch it"  # how the recorder wrote the runtime's per-call refusals


@functools.lru_cache(maxsize=None)
def rows() -> tuple[dict[str, str], ...]:
    with gzip.open(H100_TABLE, "rt", newline="") as fh:
        return tuple(csv.DictReader(fh))


def cells(family: str) -> dict[tuple[str, tuple[int, int, int, int]], tuple[float, str]]:
    """(config, (m, n, k, batch)) -> (seconds, error) of one set (``family`` tag)."""
    return {(r["config"], (int(r["m"]), int(r["n"]), int(r["k"]), int(r["batch"]))): (float(r["seconds"]), r["error"])
            for r in rows() if r["family"] == family}
