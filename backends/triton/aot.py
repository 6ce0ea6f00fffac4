"""Ahead-of-time builds: prove that every kernel of an emitted module compiles for real GPUs.

    python -m backends.triton.aot model_triton.py [--targets cuda:90,hip:gfx942] [--all-configs]

For each kernel in the module's `KERNELS` (its signature, the constexprs and
options of its first configuration at nominal sizes; every configuration with
--all-configs), `triton.compile(ASTSource(...), target=GPUTarget(...))` runs the
whole pipeline to PTX and cubin for sm_90 (`GPUTarget("cuda", 90, 32)`) and to
AMDGCN and an hsaco for gfx942 (`GPUTarget("hip", "gfx942", 64)`): no GPU needed.
A kernel that would not build on a GPU fails here, with its group named.

Builds run in a subprocess with TRITON_INTERPRET=0: where there is no GPU, the
calling process runs kernels in Triton's interpreter, and functions decorated
there cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_TARGETS = ("cuda:90", "hip:gfx942")
# Warp (wavefront) size per backend: 32 on NVIDIA, 64 on CDNA.
WARP_SIZE = {"cuda": 32, "hip": 64}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Build:
    kernel: str
    target: str
    ok: bool
    config: dict = field(default_factory=dict)
    error: str = ""
    shared: int = 0  # bytes of shared memory (LDS on AMD) a program uses
    num_warps: int = 0
    asm_bytes: int = 0  # size of the PTX / AMDGCN text


def build(module: str | Path, targets=DEFAULT_TARGETS, all_configs: bool = False) -> list[Build]:
    """Compile every kernel of an emitted module (its source, or a path to it) for `targets`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(module) if isinstance(module, Path) or (isinstance(module, str) and module.endswith(".py")
                                                            and "\n" not in module) else None
        if path is None:
            path = Path(tmp) / "module_triton.py"
            path.write_text(str(module))
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        cmd = [sys.executable, "-m", "backends.triton.aot", str(path), "--targets", ",".join(targets), "--json"]
        if all_configs:
            cmd.append("--all-configs")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode not in (0, 1) or not done.stdout.strip():
            raise RuntimeError(f"the ahead-of-time build of {path.name} failed to run: "
                               f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        return [Build(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _compile_all(path: Path, targets, all_configs: bool) -> list[Build]:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = []
    for name, entry in module.KERNELS.items():
        pairs = list(zip(entry["configs"], entry["builds"]))
        for cfg, how in pairs if all_configs else pairs[:1]:
            for target in targets:
                backend, arch = target.split(":")
                gpu = GPUTarget(backend, int(arch) if arch.isdigit() else arch, WARP_SIZE[backend])
                try:
                    compiled = triton.compile(ASTSource(fn=getattr(module, name), signature=entry["signature"],
                                                        constexprs=how["constexprs"]), target=gpu, options=how["options"])
                    asm = compiled.asm.get("ptx") or compiled.asm.get("amdgcn") or ""
                    out.append(Build(name, target, True, cfg, shared=int(compiled.metadata.shared),
                                     num_warps=int(compiled.metadata.num_warps), asm_bytes=len(asm)))
                except Exception as e:  # noqa: BLE001 - every failure is reported, named
                    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
                    out.append(Build(name, target, False, cfg, error=f"{entry.get('group', name)}: {lines[-1][:400]}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compile every kernel of an emitted Triton module for GPUs, "
                                             "without one.")
    ap.add_argument("module", type=Path, help="an emitted module (tilegraph compile --target triton -o FILE)")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated backend:arch")
    ap.add_argument("--all-configs", action="store_true", help="every autotuning candidate, not only the first")
    ap.add_argument("--json", action="store_true", help="one JSON line of results (for backends.triton.aot.build)")
    args = ap.parse_args(argv)
    if not args.module.is_file():
        print(f"error: no such file: {args.module}", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t.split(":")[0] not in WARP_SIZE or ":" not in t]
    if bad:
        print(f"error: unknown target(s) {', '.join(bad)}; use cuda:<sm> or hip:<gfx arch>", file=sys.stderr)
        return 2
    results = _compile_all(args.module, targets, args.all_configs)
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        for r in results:
            status = f"ok  shared {r.shared:>7} B  {r.num_warps} warps  {r.asm_bytes:>7} B asm" if r.ok else \
                f"FAILED  {r.error}"
            print(f"{r.kernel:<28} {r.target:<11} {status}")
        for r in results:
            if not r.ok:
                print(f"error: {r.kernel} does not build for {r.target}: {r.error}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
