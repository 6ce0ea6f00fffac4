"""all-MiniLM-L6-v2: compile time and CPU latency, tilegraph side by side with its peers.

Prints two tables, every number measured in this one run on the same inputs:
  1. compile time: tilegraph (import + passes + emit + load, from torch.export and
     from ONNX; the C backend cold, its C compiler included, and from its caches)
     vs torch.compile's first call (Inductor, default mode). The C backend's compiles
     run each in a new process (`import tilegraph` done first and not counted, as
     `import torch` is not for torch.compile), so nothing an earlier compile left in
     memory helps:
       - cold, empty cache: nothing on disk but this machine's calibrated profiles
         (measured once per machine, timed on their own line): the C runtime library
         (backends/c/runtime.c) is compiled too;
       - cold, new model: the runtime library is on disk, as after any earlier model
         on this machine: import, passes, emit, the module's C compile, load;
       - cached: the same file again (the compile cache and the module on disk).
     Under each cold row, where its time went (ONNX import, each pass, emit, cc, load).
  2. latency (median of round-robin runs, benchmarks/_common.py) at batch 1 and 8, sequence 128: tilegraph
     NumPy vs torch eager vs onnxruntime (default optimizations), with ratios.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compile_minilm.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--child-compile" not in sys.argv:  # (a child is handed its cache folder)
    # A fresh Inductor cache, so its first call compiles for real rather than loading
    # kernels an earlier run left on disk.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    # Likewise tilegraph's caches (compiled models, C modules), so that "cold" is cold.
    os.environ["TILEGRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilegraph-")
# torch and the C backend share one libgomp, which reads its wait policy once, when torch
# loads it: Inductor's spinning threads otherwise take the cores from the C module timed after
# them (MiniLM b1: 33 ms, 19 ms with this). The README asks users to do the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This directory is on sys.path when run as a script; _common adds the repository root.
from _common import interleaved_medians, machine_lines, timed  # noqa: E402

import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.testing import relative_error  # noqa: E402
from tests.models import export_onnx, minilm_inputs, minilm_model  # noqa: E402

SEQ = 128
BATCHES = (1, 8)


def child_compile(onnx_path: str) -> None:
    """(In a new process) `tilegraph.compile(onnx_path, target="c")`, timed whole and by
    stage; prints one JSON line. The stages are timed by wrapping the functions compile
    calls, so the total is that of the real call."""
    t0 = time.perf_counter()
    import tilegraph as tg
    from tilegraph import compile_cache
    from tilegraph.backends import c as cbackend
    from tilegraph.backends.c import build, runtime
    from tilegraph.frontends import onnx as onnx_frontend
    from tilegraph.ir.model import Model
    from tilegraph.passes import registry

    imported = time.perf_counter() - t0
    stages: dict[str, float] = {}

    inside = threading.local()  # a stage within another (a verify inside the cache's read) is the outer one's

    def timing(owner, attr, label):
        fn = getattr(owner, attr, None)
        if fn is None:  # (an older checkout, measured with this script for a before/after)
            return

        def timed_fn(*a, **k):
            depth = getattr(inside, "depth", 0)
            inside.depth = depth + 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside.depth = depth
                name = label(*a) if callable(label) else label
                if threading.current_thread() is not threading.main_thread():
                    name = BACKGROUND + name
                if not depth:
                    stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
        setattr(owner, attr, timed_fn)

    timing(onnx_frontend, "from_onnx", "ONNX import")
    timing(Model, "verify", "verify (every pass's result)")
    timing(Model, "clone", "copy of the model for the passes")
    for name in registry.parse_pipeline(registry.default_pipeline(getattr(cbackend, "HARDWARE", "cpu"))):
        cls = type(name)
        if "apply" in cls.__dict__:
            timing(cls, "apply", f"pass {cls.name}")
    timing(compile_cache, "store", "compile cache: store the result")
    timing(compile_cache, "key", "compile cache: key (hash the file and the library)")
    timing(compile_cache, "lookup", "compile cache: read the compiled model")
    timing(cbackend, "emit_program", "emit C")
    timing(build, "_toolchain_id", "compiler identity (cc --version)")
    if not hasattr(build, "_compile"):  # (an older checkout: the runtime compiled into every module)
        timing(build, "build", "cc: the model's module (the runtime in it)")
    timing(build, "_compile", lambda source, target, *a: "cc: the runtime library (once per machine)"
           if target.name.startswith("tgrt_") else "cc: the model's module")
    timing(runtime, "CompiledModel", "load the library, bind weights")
    t = time.perf_counter()
    tg.compile(onnx_path, target="c")
    total = time.perf_counter() - t
    print(json.dumps({"total": total, "import": imported, "stages": stages}))


# A stage run in a thread of its own beside the others (build.build_ahead starts the runtime's
# build): not in their sum.
BACKGROUND = "(beside the passes) "


def compile_in_new_process(onnx_path: Path, cache: Path) -> dict:
    env = {**os.environ, "TILEGRAPH_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, __file__, "--child-compile", str(onnx_path)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the compile in a new process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_cache(profiles: Path) -> Path:
    """A new cache folder holding only this machine's calibrated profiles (the files at
    the top of `profiles`, the parent's cache), so no compile measures the machine again."""
    cache = Path(tempfile.mkdtemp(prefix="tilegraph-c-"))
    for f in profiles.iterdir():
        if f.is_file():
            shutil.copy(f, cache / f.name)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--child-compile", metavar="ONNX", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_compile:
        return child_compile(args.child_compile)

    model = minilm_model()
    example = minilm_inputs(1, SEQ)
    print("\n".join(machine_lines()))
    print(f"all-MiniLM-L6-v2, sequence {SEQ}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")

    # --- compile time ---
    # This machine's profiles (the cost model's calibration; the C backend's where it has
    # one), measured once per machine and kept in the cache folder: timed on their own.
    from tilegraph.backends import backend
    from tilegraph.ir.hardware import cache_dir, hardware

    _, t_profiles = timed(lambda: [hardware(h) for h in {"cpu", getattr(backend("c"), "HARDWARE", "cpu")}])
    compiled_torch, t_tg_torch = timed(lambda: tilegraph.compile(model, example_inputs=example, target="numpy"))
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "minilm.onnx"
        export_onnx(model, example, onnx_path, input_names=["input_ids", "attention_mask"],
                    output_names=["last_hidden_state"],
                    dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                  "last_hidden_state": {0: "batch", 1: "seq"}})
        compiled_onnx, t_tg_onnx = timed(lambda: tilegraph.compile(str(onnx_path), target="numpy"))
        # The C backend, each compile in a new process (module docstring).
        empty = fresh_cache(cache_dir())
        c_empty = compile_in_new_process(onnx_path, empty)
        shutil.rmtree(empty / "compiled")  # the model's compiled IR and module go; the runtime stays
        for f in (empty / "c").glob("tg_*.so"):
            f.unlink()
        c_new = compile_in_new_process(onnx_path, empty)
        c_cached = compile_in_new_process(onnx_path, empty)
        os.environ["TILEGRAPH_CACHE_DIR"] = str(empty)
        compiled_c = tilegraph.compile(str(onnx_path), target="c")  # from the caches, for the latency table
        import onnxruntime as ort

        session, t_ort = timed(lambda: ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]))

    inductor = torch.compile(model)
    with torch.no_grad():
        _, t_inductor = timed(lambda: inductor(*example))

    print(f"this machine's profiles, measured once per machine (not in the rows below): {t_profiles:.2f} s")
    print(f"`import tilegraph` in a new process (not in the rows below): {c_empty['import']:.2f} s\n")
    print(f"compile time{'seconds':>59}   vs torch.compile")

    def row(name, t):
        print(f"  {name:<66} {t:7.2f}   {t / t_inductor:6.2f}x")

    def breakdown(stages, total):
        for name, t in sorted(stages.items(), key=lambda kv: -kv[1]):
            if t >= 0.005:
                print(f"      {name:<62} {t:7.2f}")
        rest = total - sum(t for name, t in stages.items() if not name.startswith(BACKGROUND))
        print(f"      {'(the rest)':<62} {rest:7.2f}")

    row("tilegraph NumPy, from torch.export (export+import+passes+emit)", t_tg_torch)
    row("tilegraph NumPy, from ONNX (import+passes+emit)", t_tg_onnx)
    for name, result in [("tilegraph C, from ONNX, cold, empty cache (runtime built too)", c_empty),
                         ("tilegraph C, from ONNX, cold, new model (runtime on disk)", c_new)]:
        row(name, result["total"])
        breakdown(result["stages"], result["total"])
    row("tilegraph C, from ONNX, cached (compile cache + module on disk)", c_cached["total"])
    breakdown(c_cached["stages"], c_cached["total"])
    row("onnxruntime InferenceSession (graph optimization)", t_ort)
    row("torch.compile first call (Inductor)", t_inductor)

    # --- latency ---
    print(f"\nlatency, median of {args.repeats} (round-robin)  ms      vs torch eager   vs onnxruntime")
    for batch in BATCHES:
        ids, mask = minilm_inputs(batch, SEQ)
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        with torch.no_grad():
            reference = model(ids, mask).numpy()
        ours = compiled_onnx(feeds["input_ids"], feeds["attention_mask"])
        err = relative_error(ours, reference)
        err_c = relative_error(compiled_c(feeds["input_ids"], feeds["attention_mask"]), reference)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn(ids, mask)
            return run

        t = interleaved_medians({"ours": lambda: compiled_onnx(feeds["input_ids"], feeds["attention_mask"]),
                                 "c": lambda: compiled_c(feeds["input_ids"], feeds["attention_mask"]),
                                 "eager": no_grad(model), "inductor": no_grad(inductor),
                                 "ort": lambda: session.run(None, feeds)}, args.repeats)
        t_ours, t_eager, t_inductor, t_ort = t["ours"], t["eager"], t["inductor"], t["ort"]
        print(f"batch {batch} (max rel err vs eager: tilegraph NumPy {err:.1e}, C {err_c:.1e})")
        for name, t in [("tilegraph NumPy", t_ours), ("tilegraph C", t["c"]), ("torch eager", t_eager),
                        ("torch.compile (steady state)", t_inductor), ("onnxruntime", t_ort)]:
            print(f"  {name:<30} {1e3 * t:9.2f}   {t / t_eager:8.2f}x   {t / t_ort:12.2f}x")


if __name__ == "__main__":
    main()
