"""Autotuning, bounded by the cost model: time only the tile pass's candidates, keep the winner.

The `tile` pass ranks GPU configurations by predicted time and writes the best few
on each group (`configs`); the first is what runs without autotuning. With it
(`tilegraph.compile(..., target="triton", autotune=True)`), the first launch of a
kernel at new shapes times every candidate, keeps the fastest and records it on
disk, keyed by kernel, the module's source hash (the module is written for its
dtypes), the shapes of its inputs, and the device's name; later processes read the winner back without
timing anything.

Timing: `triton.testing.do_bench` on a GPU. Without one (Triton's interpreter) the
times are real but of the interpreter, so a warning says so once. A candidate that
fails to launch (out of shared memory or registers) is recorded with its error and
skipped; only if every candidate fails is that an error.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Callable

# Interpreter timing: timed runs per candidate, after one untimed run.
CPU_RUNS = 2


def default_cache_dir() -> Path:
    from tilegraph.ir.cache import private_dir

    return private_dir("autotune")


class Autotuner:
    def __init__(self, enabled: bool = True, cache_dir: Path | None = None):
        self.enabled = enabled
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.memory: dict[tuple, dict] = {}
        self.timed = 0  # candidates timed by this tuner (what a cache hit saves)
        self._warned = False

    def pick(self, kernel: str, source_hash: str, key: tuple, device: str, configs: list[dict],
             launch: Callable[[dict], None]) -> dict:
        """The configuration to launch `kernel` with for `key` (shapes and dtypes) on `device`."""
        if not self.enabled or len(configs) <= 1:
            return configs[0]
        slot = (kernel, source_hash, device, repr(key))
        if slot in self.memory:
            return self.memory[slot]
        path = self._path(kernel, source_hash, device)
        table = self._read(path)
        entry = table.get(repr(key))
        if isinstance(entry, dict) and entry.get("best") in configs:  # else never tuned, or stale: tune
            self.memory[slot] = entry["best"]
            return entry["best"]
        timings = [self._time(cfg, launch, device) for cfg in configs]
        ok = [(t, i) for i, (t, _) in enumerate(timings) if t is not None]
        if not ok:
            errors = "; ".join(f"{cfg}: {err}" for cfg, (_, err) in zip(configs, timings))
            raise RuntimeError(f"autotuning {kernel}: no candidate configuration launches: {errors}")
        best = configs[min(ok)[1]]
        # Read again: another process may have tuned other shapes of this kernel meanwhile.
        table = self._read(path)
        table[repr(key)] = {"best": best, "timings": [{"config": cfg, "seconds": t, "error": err}
                                                      for cfg, (t, err) in zip(configs, timings)]}
        try:
            self._write(path, table)
        except OSError as e:  # an unwritable cache costs a re-tune next process, never the run
            warnings.warn(f"autotuning cache not written ({path}): {e}", stacklevel=2)
        self.memory[slot] = best
        return best

    def _time(self, cfg: dict, launch: Callable[[dict], None], device: str) -> tuple[float | None, str]:
        self.timed += 1
        try:
            if device != "cpu-interpreter":
                import triton.testing

                return triton.testing.do_bench(lambda: launch(cfg), return_mode="median") * 1e-3, ""
            if not self._warned:
                warnings.warn("autotuning in Triton's interpreter: the times are the interpreter's, not a GPU's",
                              stacklevel=3)
                self._warned = True
            launch(cfg)
            start = time.perf_counter()
            for _ in range(CPU_RUNS):
                launch(cfg)
            return (time.perf_counter() - start) / CPU_RUNS, ""
        except Exception as e:  # noqa: BLE001 - a candidate that cannot launch is skipped, with its reason
            return None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"

    def _path(self, kernel: str, source_hash: str, device: str) -> Path:
        safe = "".join(c if c.isalnum() else "_" for c in device)
        return self.cache_dir / f"{kernel}-{source_hash}-{safe}.json"

    @staticmethod
    def _read(path: Path) -> dict:
        from tilegraph.ir import cache

        if not cache.verified(path):  # none yet, or edited, planted or damaged: tune again, never trust it
            return {}
        try:
            table = json.loads(path.read_text())
            return table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            return {}  # no cache yet, or a corrupt one: tune again

    @staticmethod
    def _write(path: Path, table: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        from tilegraph.ir import cache

        cache.place(tmp, path)  # 0600, with the digest _read checks
