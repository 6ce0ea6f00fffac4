"""Ahead-of-time builds: prove that every kernel of an emitted module compiles for real GPUs.

    python -m backends.triton.aot model_triton.py [more_triton.py ...] [--targets cuda:90,hip:gfx942] [--all-configs]

For each kernel in the module's `KERNELS`, `triton.compile(ASTSource(...),
target=GPUTarget(...))` runs Triton's whole pipeline, to PTX and a cubin for sm_90
(`GPUTarget("cuda", 90, 32)`) and to AMDGCN and an hsaco for gfx942
(`GPUTarget("hip", "gfx942", 64)`): no GPU is needed. A kernel that would not build
on a GPU fails here, named with its group and the line of the module at fault.

What is compiled: the kernel's `signature` (pointer types from
`backends.triton.group_kernels.POINTER_TYPES`), with the constexprs and options of its
first configuration (every one with --all-configs). The emitter writes those per
configuration at nominal sizes (`builds`: [{"constexprs", "options"}]); a module
without `builds` takes the constexprs from each configuration (falling back to the
entry's `constexprs`) and num_warps / num_stages from it too.

Specialized as a launch would be. At a launch, Triton specializes each argument
(`native_specialize_impl`): a pointer to a freshly allocated tensor is known
16-byte aligned (on AMD also within 2 GB), an int equal to 1 becomes a constant,
one divisible by 16 is marked so. Those facts are what let a GEMM vectorize its
loads and pipeline them through shared memory (cp.async / TMA), so a build without
them is a different, smaller kernel: measured here, an fp16 64x64x32 GEMM in 4
stages needs 8 KiB of shared memory unspecialized and 32 KiB specialized. So every
pointer is specialized like an aligned tensor, and the ints named in the build's
optional `args` ({param: value at nominal sizes}: strides, dims) like those values;
`specialize=False` (--generic) builds the unspecialized kernel instead.

Builds run in a subprocess with TRITON_INTERPRET=0: on a machine without a GPU the
calling process runs kernels in Triton's interpreter (`import tilegraph` sets
TRITON_INTERPRET=1), and functions decorated there cannot be compiled. "0", not
unset: importing `backends.triton` would otherwise set it to 1 again. Starting that
subprocess (Python, torch, Triton) costs about 4 s of CPU, so `build_many` builds
several modules in one (tests/test_triton_build.py's thirteen: 209 s of CPU with a
subprocess each, 164 s with one, measured with an empty Triton cache).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tilegraph.backends.triton.group_kernels import f32_dot_precision
from tilegraph.ir.errors import TilegraphError

DEFAULT_TARGETS = ("cuda:90", "hip:gfx942")
# Warp (wavefront) size per backend: 32 on NVIDIA, 64 on CDNA (Triton's GPUTarget.warp_size).
WARP_SIZE = {"cuda": 32, "hip": 64}
# The text each backend's assembly is kept as in `compiled.asm` (its binary: cubin / hsaco).
ASM_KIND = {"cuda": "ptx", "hip": "amdgcn"}
# Launch options a configuration may carry next to its constexprs.
OPTIONS = ("num_warps", "num_stages")
# Tensor-core instructions in PTX, with their shape and operand types (mma.sync on sm_80+,
# wgmma on sm_90a, tcgen05.mma on sm_100a): what a kernel multiplies in, for tests and reports.
MMA_PATTERN = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.:]*")
# An error message is one line in a table: longer ones are cut here.
MAX_ERROR_CHARS = 300
ROOT = Path(__file__).resolve().parents[2]


class BuildError(TilegraphError):
    """The module itself could not be built from: missing, not importable, or without KERNELS."""


@dataclass
class Build:
    kernel: str
    target: str
    ok: bool
    config: dict = field(default_factory=dict)
    error: str = ""  # one line: the kernel, its group, Triton's message and the line at fault
    specialized: bool = True  # built for aligned pointers and the build's `args` (see the module docstring)
    shared: int = 0  # bytes of shared memory (LDS on AMD) one program uses
    num_warps: int = 0
    asm_bytes: int = 0  # size of the PTX (cuda) / AMDGCN (hip) text
    seconds: float = 0.0  # how long Triton took (0 when its on-disk cache had the kernel)
    mma: list = field(default_factory=list)  # the tensor-core instructions in the PTX, as spelled there


def build(module: str | Path, targets=DEFAULT_TARGETS, all_configs: bool = False,
          specialize: bool = True) -> list[Build]:
    """Compile every kernel of an emitted module (its source, or a path to it) for `targets`.

    One subprocess does all the builds (see the module docstring); a kernel that does
    not build is a `Build` with ok=False, a module that cannot be read is a BuildError."""
    return build_many([module], targets, all_configs, specialize)[0]


def build_many(modules: Sequence[str | Path], targets=DEFAULT_TARGETS, all_configs: bool = False,
               specialize: bool = True) -> list[list[Build]]:
    """`build` for several modules in one subprocess: one list of builds per module, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, module in enumerate(modules):
            if isinstance(module, Path) or ("\n" not in module and module.endswith(".py")):
                paths.append(Path(module).resolve())  # the subprocess runs in the repository root
            else:
                paths.append(Path(tmp) / f"module{i or ''}_triton.py")
                paths[-1].write_text(module)
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        cmd = [sys.executable, "-m", "tilegraph.backends.triton.aot", *map(str, paths), "--targets", ",".join(targets), "--json"]
        if all_configs:
            cmd.append("--all-configs")
        if not specialize:
            cmd.append("--generic")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
        last = (errors or done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        names = ", ".join(p.name for p in paths)
        raise BuildError(f"the ahead-of-time build of {names} did not run: {last.removeprefix('error: ')}")
    return [[Build(**row) for row in rows] for rows in json.loads(done.stdout.strip().splitlines()[-1])]


def parse_target(text: str):
    """'cuda:90' -> GPUTarget("cuda", 90, 32); 'hip:gfx942' -> GPUTarget("hip", "gfx942", 64)."""
    from triton.backends.compiler import GPUTarget

    backend, _, arch = text.partition(":")
    return GPUTarget(backend, int(arch) if arch.isdigit() else arch, WARP_SIZE[backend])


def config_builds(entry: dict, all_configs: bool) -> list[tuple[dict, dict, dict, dict]]:
    """(configuration, constexprs, options, args) for each configuration of a KERNELS entry to build."""
    configs = entry.get("configs") or [{}]
    if "builds" in entry:
        rows = [(cfg, how["constexprs"], how["options"], how.get("args", entry.get("args", {})))
                for cfg, how in zip(configs, entry["builds"])]
    else:
        names = [p for p, kind in entry["signature"].items() if kind == "constexpr"]
        defaults = entry.get("constexprs", {})
        rows = [(cfg, {p: cfg.get(p, defaults.get(p)) for p in names}, {o: cfg[o] for o in OPTIONS if o in cfg},
                 entry.get("args", {})) for cfg in configs]
    return rows if all_configs else rows[:1]


def specialized(fn, signature: dict, constexprs: dict, args: dict, target) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource as a launch on `target` would specialize them:
    pointers as a freshly allocated tensor, the ints in `args` by their values (Triton's own rule)."""
    import torch
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl  # what JITFunction.run uses

    rules = type(make_backend(target))
    signature, constexprs, attrs = dict(signature), dict(constexprs), {}
    # (value, is_const, specialize, align): as for a parameter without do_not_specialize.
    _, aligned = native_specialize_impl(rules, torch.empty(16, dtype=torch.uint8), False, True, True)
    for name, kind in list(signature.items()):
        index = (fn.arg_names.index(name),)
        if kind.startswith("*"):
            attrs[index] = rules.parse_attr(aligned)
        elif name in args:
            spelled, desc = native_specialize_impl(rules, int(args[name]), False, True, True)
            if spelled == "constexpr":  # == 1: folded into the kernel
                signature[name], constexprs[name] = "constexpr", int(args[name])
            elif desc:
                attrs[index] = rules.parse_attr(desc)
    return signature, constexprs, attrs


def describe_error(e: Exception, fn, kernel: str, group: str) -> str:
    """One line: the kernel, its group, Triton's message and the module line at fault.

    Triton's CompilationError prints the source up to the bad line and a caret; the
    message itself is `error_message` on the innermost error that has one (a helper
    @triton.jit function's error is the cause of its caller's)."""
    from triton.compiler.errors import CompilationError

    chain, c = [], e
    while c is not None and len(chain) < 16:
        chain.append(c)
        c = c.__cause__  # type: ignore[assignment]
    message = next((c.error_message for c in chain if isinstance(c, CompilationError) and c.error_message), None)
    if message is None:
        inner = chain[-1]
        lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip() and ln.strip() != "^"]
        message = f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
    where = ""
    lineno = getattr(getattr(e, "node", None), "lineno", None)
    if isinstance(e, CompilationError) and lineno and e.src and hasattr(fn, "def_file_line_number"):
        # e.node.lineno counts from the kernel's `def` line.
        code = e.src.split("\n")[lineno - 1].strip() if lineno <= len(e.src.split("\n")) else ""
        where = f" (line {fn.def_file_line_number + lineno - 1}: {code})"
    text = f"{kernel} ({group}): {' '.join(message.split())}{where}"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def import_module(path: Path):
    """Import an emitted module from its file; BuildError naming the file when that fails."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - any failure to import is the module's, reported in one line
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BuildError(f"{path.name} does not import: {type(e).__name__}: {detail}") from None
    if not isinstance(getattr(module, "KERNELS", None), dict):
        raise BuildError(f"{path.name} has no KERNELS table (is it a tilegraph Triton module?)")
    return module


def compile_all(path: Path, targets, all_configs: bool, specialize: bool = True) -> list[Build]:
    """Every (kernel, configuration, target) of the module at `path`, built in this process
    (which must not be interpreting Triton: see the module docstring)."""
    import triton
    from triton.compiler import ASTSource

    module = import_module(path)
    out = []
    for name, entry in module.KERNELS.items():
        group = entry.get("group", name)
        fn = getattr(module, name, None)
        for cfg, constexprs, options, args in config_builds(entry, all_configs):
            for target in targets:
                if fn is None:
                    out.append(Build(name, target, False, cfg, error=f"{name} ({group}): not defined in the module"))
                    continue
                gpu = parse_target(target)
                module.F32_DOT = triton.language.constexpr(f32_dot_precision(gpu.backend, gpu.arch))
                start = time.perf_counter()
                try:
                    signature, values, attrs = (specialized(fn, entry["signature"], constexprs, args, gpu)
                                                if specialize else (entry["signature"], constexprs, {}))
                    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs),
                                              target=gpu, options=options)
                except Exception as e:  # noqa: BLE001 - every failure is reported, named, and the rest still build
                    out.append(Build(name, target, False, cfg, specialized=specialize,
                                     error=describe_error(e, fn, name, group)))
                    continue
                asm = compiled.asm.get(ASM_KIND[target.split(":")[0]], "")
                out.append(Build(name, target, True, cfg, specialized=specialize, shared=int(compiled.metadata.shared),
                                 num_warps=int(compiled.metadata.num_warps), asm_bytes=len(asm),
                                 seconds=round(time.perf_counter() - start, 3),
                                 mma=sorted(set(MMA_PATTERN.findall(asm)))))
    return out


def short_config(cfg: dict) -> str:
    """{'BLOCK_M': 64, 'num_warps': 4, 'num_stages': 3} -> 'M=64 warps=4 stages=3' (a table column)."""
    return " ".join(f"{k.removeprefix('BLOCK_').removeprefix('num_')}={v}" for k, v in cfg.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.triton.aot",
                                 description="Compile every kernel of an emitted Triton module for GPUs, without one.")
    ap.add_argument("modules", type=Path, nargs="+", metavar="module",
                    help="an emitted module (tilegraph compile --target triton -o FILE); several build in turn")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated backend:arch")
    ap.add_argument("--all-configs", action="store_true", help="every autotuning candidate, not only the first")
    ap.add_argument("--generic", action="store_true",
                    help="build without a launch's specialization (aligned pointers, the ints in `args`)")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line: a list of results per module (for backends.triton.aot.build_many)")
    args = ap.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t.partition(":")[0] not in WARP_SIZE or not t.partition(":")[2]]
    if bad or not targets:
        print(f"error: unknown target(s) {', '.join(bad) or '(none)'}; use cuda:<sm> or hip:<gfx arch>",
              file=sys.stderr)
        return 2
    missing = [str(m) for m in args.modules if not m.is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    # Compile, never interpret (see the module docstring); Triton reads this when a
    # function is decorated, so before the module (and tlmath, its helpers) is imported.
    os.environ["TRITON_INTERPRET"] = "0"
    # Triton 3.9's default, said explicitly: otherwise it warns on every run that it will change.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for helpers in ("tilegraph.backends.triton.tlmath", "tilegraph.backends.triton.tlquant"):
        if helpers in sys.modules:
            importlib.reload(sys.modules[helpers])
    try:
        per_module = [compile_all(path, targets, args.all_configs, not args.generic) for path in args.modules]
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = [r for rows in per_module for r in rows]
    if args.json:
        print(json.dumps([[asdict(r) for r in rows] for rows in per_module]))
    else:
        for path, rows in zip(args.modules, per_module):
            if len(args.modules) > 1:
                print(f"{path}:")
            for r in rows:
                status = (f"ok  shared {r.shared:>7} B  {r.num_warps} warps  {r.asm_bytes:>8} B "
                          f"{ASM_KIND[r.target.split(':')[0]]}  {r.seconds:5.2f} s") if r.ok else "FAILED"
                print(f"{r.kernel:<28} {r.target:<11} {status}  {short_config(r.config)}".rstrip())
        failed = [r for r in results if not r.ok]
        for r in failed:
            print(f"error: does not build for {r.target}: {r.error}", file=sys.stderr)
        print(f"{len(results) - len(failed)} of {len(results)} builds ok", file=sys.stderr if failed else sys.stdout)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
