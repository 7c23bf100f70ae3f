"""The measurement database: SQLite (standard library, WAL) reused across runs and models.

A row is keyed by (device key, family signature, config key, problem). Every query filters by the
device key, so timings from another GPU, driver or Triton version never leak into a decision. Each
``put`` is one transaction: a run killed at any point loses at most the batch in flight, and the
``CachingMeasurer`` wrapper makes a restarted run skip everything already stored. Transient failures are
never stored (see ``put``).
"""
from __future__ import annotations

import functools
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dietcode_ort.errors import DietcodeError
from dietcode_ort.paths import writable_dir
from tuner.measure import VENDOR_KEY, MeasureResult, Measurer
from tuner.space import Family, MicroKernel
from tuner.workload import Problem

__all__ = ["Database", "CachingMeasurer", "family_signature", "row_key"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    device TEXT NOT NULL,
    family TEXT NOT NULL,
    config TEXT NOT NULL,
    m INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL, batch INTEGER NOT NULL,
    image TEXT NOT NULL,
    seconds REAL,
    error TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (device, family, config, m, n, k, batch, image)
) WITHOUT ROWID;
"""
SCHEMA_VERSION = 1  # PRAGMA user_version: the layout above (files made before it was set read 0)
Pair = tuple[MicroKernel, Problem]
RowKey = tuple[str, int, int, int, int, str]


def family_signature(family: Family, context: str = "") -> str:
    """Stable text naming a family (op/dtype/target) plus what else fixes the kernel being timed
    (``Measurer.context()``: epilogue, trans_b, conv geometry), so such timings never mix."""
    base = f"{family.op}/{family.dtype}/{family.target}"
    return f"{base}|{context}" if context else base


def _image(problem: Problem) -> str:
    return "" if problem.image is None else "x".join(map(str, problem.image))


def _config_key(config: MicroKernel | str) -> str:
    return config if isinstance(config, str) else config.key()


def row_key(config: str, problem: Problem) -> RowKey:
    return (config, problem.m, problem.n, problem.k, problem.batch, _image(problem))


def _columns(conn: sqlite3.Connection) -> tuple[str, ...]:
    return tuple(r[1] for r in conn.execute("PRAGMA table_info(measurements)"))


@functools.lru_cache(maxsize=1)
def _schema_columns() -> tuple[str, ...]:
    """The columns ``_SCHEMA`` makes, read from a table it creates in memory (one definition of the layout)."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(_SCHEMA)
        return _columns(conn)
    finally:
        conn.close()


class Database:
    """Measurements on disk. A locked or damaged file raises DietcodeError naming the file."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise DietcodeError(f"measurement database {self.path} is a folder; give --db a file path")
        writable_dir(self.path.parent, "measurement database", "--db FILE")
        self.timeout_s = timeout_s
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
            self._retry_busy(lambda: self._conn.execute("PRAGMA journal_mode=WAL"))
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._retry_busy(lambda: self._conn.executescript(_SCHEMA))
            self._conn.execute("SELECT count(*) FROM measurements LIMIT 1").fetchone()
            self._check_layout()
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _check_layout(self) -> None:
        """Refuse, at open rather than at the first write minutes later, a file whose ``measurements`` table is
        another one (a foreign database, or a newer dietcode-ort's layout); mark a file of this layout."""
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        columns = _columns(self._conn)
        if version > SCHEMA_VERSION:
            raise DietcodeError(f"measurement database {self.path} has layout {version}, this dietcode-ort knows "
                                f"{SCHEMA_VERSION}: a newer version wrote it; update dietcode-ort or use another --db file")
        if columns != _schema_columns():
            raise DietcodeError(f"measurement database {self.path} holds a measurements table of other columns "
                                f"({', '.join(columns)}): not one dietcode-ort wrote; use another --db file")
        if version < SCHEMA_VERSION:
            try:
                self._retry_busy(lambda: self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}"))
            except sqlite3.OperationalError as exc:  # a read-only file still serves what it holds
                if "readonly" not in str(exc):
                    raise

    def _retry_busy(self, step: Callable[[], object]) -> None:
        """Run ``step``, retrying while the file is busy for up to ``timeout_s``. SQLite's busy timeout does not
        cover every case of two processes on one WAL file: a connection that finds another one switching the
        new file to WAL, running recovery or holding a stale snapshot gets SQLITE_BUSY at once."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.01
        while True:
            try:
                step()
                return
            except sqlite3.OperationalError as exc:
                text = str(exc)
                if ("locked" not in text and "busy" not in text) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _error(self, exc: sqlite3.Error) -> DietcodeError:
        text = str(exc)
        if "locked" in text or "busy" in text:
            return DietcodeError(f"measurement database {self.path} is locked by another process ({text}); "
                                 f"wait for it to finish or use another --db file")
        if "not a database" in text or "malformed" in text or "corrupt" in text:
            return DietcodeError(f"measurement database {self.path} is corrupt ({text}); move it aside and "
                                 f"re-run (measurements will be taken again)")
        if "readonly" in text or "read-only" in text or "unable to open" in text:
            return DietcodeError(f"measurement database {self.path} cannot be written ({text}); make it "
                                 f"writable or use another --db file")
        return DietcodeError(f"measurement database {self.path}: {text}; use another --db file")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, device: str, family: Family, pairs: Sequence[tuple[MicroKernel | str, Problem]], context: str = ""
            ) -> dict[RowKey, MeasureResult]:
        """Stored results for ``pairs`` on ``device`` (only those present), keyed by config and problem.

        A pair's config is a MicroKernel, or the string VENDOR_KEY for the vendor library's time."""
        wanted = {row_key(_config_key(c), p) for c, p in pairs}
        return {k: v for k, v in self.rows(device, family, context).items() if k in wanted}

    def rows(self, device: str, family: Family, context: str = "") -> dict[RowKey, MeasureResult]:
        """Every stored result of ``family`` on ``device``."""
        try:
            cur = self._conn.execute(
                "SELECT config, m, n, k, batch, image, seconds, error FROM measurements "
                "WHERE device = ? AND family = ?", (device, family_signature(family, context)))
            return {tuple(r[:6]): MeasureResult(math.inf if r[6] is None else r[6], r[7])  # type: ignore[misc]
                    for r in cur.fetchall()}
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def put(self, device: str, family: Family, pairs: Sequence[tuple[MicroKernel | str, Problem]],
            results: Sequence[MeasureResult],
            context: str = "") -> None:
        """Store one batch in one transaction (all or nothing). Transient failures (``MeasureResult.transient``:
        a timing process that died or lost its CUDA context, a timeout) are not stored: they may come from
        another kernel of the same context, and a later run measures them again."""
        if len(pairs) != len(results):
            raise DietcodeError(f"put: {len(pairs)} pairs but {len(results)} results")
        now = time.time()
        fam = family_signature(family, context)
        rows = [(device, fam, *row_key(_config_key(c), p), r.seconds if math.isfinite(r.seconds) else None, r.error, now)
                for (c, p), r in zip(pairs, results) if not r.transient]
        def write() -> None:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany("INSERT OR REPLACE INTO measurements VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)

        try:
            self._retry_busy(write)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def count(self, device: str | None = None) -> int:
        try:
            if device is None:
                return int(self._conn.execute("SELECT count(*) FROM measurements").fetchone()[0])
            return int(self._conn.execute("SELECT count(*) FROM measurements WHERE device = ?",
                                          (device,)).fetchone()[0])
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def devices(self) -> list[str]:
        try:
            return [r[0] for r in self._conn.execute("SELECT DISTINCT device FROM measurements ORDER BY 1")]
        except sqlite3.Error as exc:
            raise self._error(exc) from None


class CachingMeasurer(Measurer):
    """Consults the database first and measures only what is missing; each batch is stored at once."""

    def __init__(self, inner: Measurer, db: Database) -> None:
        self.inner = inner
        self.db = db
        self._device = inner.device_key()
        self._context = inner.context()
        self.hits = 0
        self.misses = 0

    def device_key(self) -> str:
        return self._device

    def measure(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[MeasureResult]:
        return self._cached(family, configs_and_problems,
                            lambda pairs, store: self.inner.measure_each(family, pairs, store))

    def _cached(self, family: Family, configs_and_problems: Sequence[tuple[MicroKernel | str, Problem]],
                measure: Callable[[list, Callable], list[MeasureResult]]) -> list[MeasureResult]:
        """``measure(pairs, store)`` measures the missing pairs and calls ``store`` with each finished part,
        which is written at once (a distributed measurer finishes its batch in parts)."""
        known = self.db.get(self._device, family, configs_and_problems, self._context)
        keys = [row_key(_config_key(c), p) for c, p in configs_and_problems]
        todo = [i for i, k in enumerate(keys) if k not in known]
        if todo:
            pairs = [configs_and_problems[i] for i in todo]
            fresh = measure(pairs, lambda done, results: self.db.put(self._device, family, done, results,
                                                                     self._context))
            for i, r in zip(todo, fresh):
                known[keys[i]] = r
        self.hits += len(keys) - len(todo)
        self.misses += len(todo)
        return [known[k] for k in keys]

    def context(self) -> str:
        return self._context

    def refusals(self, family: Family, configs_and_problems: Sequence[Pair]) -> list[str | None]:
        return self.inner.refusals(family, configs_and_problems)

    def refusal_matrix(self, family: Family, configs: Sequence[MicroKernel], problems: Sequence[Problem]) -> Any:
        return self.inner.refusal_matrix(family, configs, problems)

    def measure_vendor(self, family: Family, problems: Sequence[Problem]) -> list[MeasureResult]:
        """The vendor library's times, stored like kernels' under the config key VENDOR_KEY."""
        return self._cached(family, [(VENDOR_KEY, p) for p in problems],
                            lambda pairs, store: _stored(pairs, self.inner.measure_vendor(
                                family, [p for _, p in pairs]), store))


def _stored(pairs: list, results: list[MeasureResult], store: Callable) -> list[MeasureResult]:
    store(pairs, results)
    return results
