"""Ahead-of-time builds compile every kernel of a module for sm_90 and gfx942, and name the ones that fail.

The module here is written by hand in the emitter's format (KERNELS: signature,
constexprs, ranked configs, group), so these tests hold `backends.triton.aot` to its
contract independently of what the emitter writes today: an elementwise kernel that
calls a @triton.jit helper, a tl.dot GEMM with block constexprs and two
configurations (built as launched at given sizes, and without them), a copy kernel
for every pointer type the emitter can name, and two kernels that do not build.
`tests/test_triton_build.py` builds what the emitter writes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tilegraph.backends.triton.aot import ROOT, Build, BuildError, build, build_many, config_builds, parse_target, specialized
from tilegraph.backends.triton.group_kernels import POINTER_TYPES

KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def _scale(x, alpha):
    return x * alpha


@triton.jit
def scale_kernel(x, out, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask).to(tl.float32)
    tl.store(out + offs, _scale(v, alpha).to(out.dtype.element_ty), mask=mask)


@triton.jit
def gemm_kernel(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k * BLOCK_K + rk
        x = tl.load(a + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        y = tl.load(b + kk[:, None] * N + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def copy_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _broken_helper(x):
    return x + no_such_name


@triton.jit
def helper_error_kernel(x, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, _broken_helper(tl.load(x + offs)))


@triton.jit
def block_error_kernel(x, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs))
'''

# The module fixture's build is shared: on one xdist worker, it runs once.
pytestmark = pytest.mark.xdist_group("triton_aot")

GEMM_CONFIGS = [{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}]
# The GEMM's sizes at a launch: K a multiple of 16 lets Triton vectorize and pipeline its loads.
GEMM_ARGS = {"M": 512, "N": 512, "K": 256}
BROKEN = {"helper_error_kernel": "NameError", "block_error_kernel": "power of 2"}


def kernels_table() -> dict:
    sig = {"x": "*fp32", "BLOCK": "constexpr"}
    table = {
        "scale_kernel": {"signature": {"x": "*bf16", "out": "*fp16", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"},
                         "constexprs": {"BLOCK": 1024}, "configs": [{"BLOCK": 1024, "num_warps": 4, "num_stages": 1}],
                         "group": "elementwise: mul cast"},
        "gemm_kernel": {"signature": {"a": "*fp16", "b": "*fp16", "c": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                                      "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                        "constexprs": {k: v for k, v in GEMM_CONFIGS[0].items() if k.startswith("BLOCK")},
                        "configs": GEMM_CONFIGS, "group": "matmul: matmul", "args": GEMM_ARGS},
        # 10 is not a power of two: tl.arange refuses it.
        "block_error_kernel": {"signature": sig, "constexprs": {"BLOCK": 10},
                               "configs": [{"BLOCK": 10, "num_warps": 1}], "group": "elementwise: broken block"},
        "helper_error_kernel": {"signature": sig, "constexprs": {"BLOCK": 16},
                                "configs": [{"BLOCK": 16, "num_warps": 1}], "group": "elementwise: broken helper"},
    }
    # The same GEMM with its sizes unknown (no `args`): what a launch with K = 100 compiles.
    table["gemm_any_k"] = {**{k: v for k, v in table["gemm_kernel"].items() if k != "args"}, "configs": GEMM_CONFIGS[:1]}
    for dtype, pointer in POINTER_TYPES.items():
        table[f"copy_{dtype}"] = {"signature": {"x": pointer, "out": pointer, "n": "i64", "BLOCK": "constexpr"},
                                  "constexprs": {"BLOCK": 256}, "configs": [{"BLOCK": 256, "num_warps": 2}],
                                  "group": f"copy: {dtype}"}
    return table


def module_source() -> str:
    aliases = "gemm_any_k = gemm_kernel\n" + "".join(f"copy_{dtype} = copy_kernel\n" for dtype in POINTER_TYPES)
    return KERNEL_SOURCE + "\n" + aliases + f"\nKERNELS = {kernels_table()!r}\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str, int], Build]:
    """One build of the whole module, every configuration, both targets (one subprocess)."""
    path = tmp_path_factory.mktemp("aot") / "handwritten_triton.py"
    path.write_text(module_source())
    return {(r.kernel, r.target, r.config.get("num_warps", 0)): r for r in build(path, all_configs=True)}


def test_every_good_kernel_builds_for_hopper_and_cdna3(results):
    good = [name for name in kernels_table() if name not in BROKEN]
    for name in good:
        for target in ("cuda:90", "hip:gfx942"):
            rows = [r for key, r in results.items() if key[:2] == (name, target)]
            assert rows, f"{name} was not built for {target}"
            for r in rows:
                assert r.ok, r.error
                assert r.asm_bytes > 0, f"{name} on {target}: no PTX/AMDGCN text"


def test_every_pointer_type_the_emitter_names_builds(results):
    """POINTER_TYPES (tg dtype -> Triton signature type) is what the emitter writes: each must compile."""
    for dtype in POINTER_TYPES:
        for target in ("cuda:90", "hip:gfx942"):
            r = results[(f"copy_{dtype}", target, 2)]
            assert r.ok and r.num_warps == 2, f"a *{dtype} kernel does not build for {target}: {r.error}"


def test_every_gemm_configuration_builds_with_its_warps_and_shared_memory(results):
    """tl.dot stages its tiles through shared memory, and a bigger tile needs more of it."""
    for target in ("cuda:90", "hip:gfx942"):
        small, big = (results[("gemm_kernel", target, cfg["num_warps"])] for cfg in GEMM_CONFIGS)
        assert small.ok and big.ok, small.error or big.error
        assert (small.num_warps, big.num_warps) == (4, 8)
        assert 0 < small.shared < big.shared, (target, small.shared, big.shared)
    # The elementwise kernel stages nothing.
    assert results[("scale_kernel", "cuda:90", 4)].shared == 0


def test_builds_are_specialized_like_launches_so_gemm_tiles_are_pipelined(results):
    """With K % 16 == 0 and aligned pointers, the build copies tiles asynchronously into one
    shared-memory buffer per stage; not knowing K, it cannot, and needs less. A build without
    a launch's facts would check a smaller kernel than the one that runs."""
    cfg = GEMM_CONFIGS[0]
    one_stage = (cfg["BLOCK_M"] * cfg["BLOCK_K"] + cfg["BLOCK_K"] * cfg["BLOCK_N"]) * 2  # fp16 A and B tiles
    for target in ("cuda:90", "hip:gfx942"):
        pipelined, generic = results[("gemm_kernel", target, 4)], results[("gemm_any_k", target, 4)]
        assert pipelined.ok and generic.ok and pipelined.specialized
        assert generic.shared < pipelined.shared, (target, generic.shared, pipelined.shared)
    assert results[("gemm_kernel", "cuda:90", 4)].shared == cfg["num_stages"] * one_stage


def test_specialization_follows_tritons_rule_for_launch_arguments():
    """A pointer is an aligned tensor's (and within 2 GB on AMD); ints: 1 is a constant, multiples of 16 marked."""
    table = kernels_table()["scale_kernel"]

    class Fn:  # what specialized() reads of a JITFunction
        arg_names = list(table["signature"])

    for target, pointer in (("cuda:90", [["tt.divisibility", 16]]),
                            ("hip:gfx942", [["tt.divisibility", 16], ["tt.pointer_range", 32]])):
        sig, values, attrs = specialized(Fn, table["signature"], {"BLOCK": 1024}, {"n": 1}, parse_target(target))
        assert attrs == {(0,): pointer, (1,): pointer}
        assert sig["n"] == "constexpr" and values == {"BLOCK": 1024, "n": 1}
        sig, values, attrs = specialized(Fn, table["signature"], {"BLOCK": 1024}, {"n": 4096}, parse_target(target))
        assert sig["n"] == "i32" and attrs[(2,)] == [["tt.divisibility", 16]]
        assert (3,) not in attrs  # alpha: a float, never specialized
        assert 2 not in specialized(Fn, table["signature"], {}, {"n": 100}, parse_target(target))[2]


def test_a_kernel_that_does_not_build_is_named_and_the_others_still_build(results):
    lines = KERNEL_SOURCE.splitlines()
    for name, message in BROKEN.items():
        for target in ("cuda:90", "hip:gfx942"):
            r = results[(name, target, 1)]
            assert not r.ok
            group = kernels_table()[name]["group"]
            assert r.error.startswith(f"{name} ({group}): "), r.error
            assert message in r.error, r.error
            assert "\n" not in r.error
            # The line at fault is the kernel's own line that fails (the call into a broken helper).
            start = lines.index(f"def {name}(x, BLOCK: tl.constexpr):")
            n = next(i for i in range(start, len(lines))
                     if ("_broken_helper" if "helper" in name else "arange") in lines[i])
            assert r.error.endswith(f"(line {n + 1}: {lines[n].strip()})"), r.error  # lines[0] is line 1
    assert sum(r.ok for r in results.values()) == len(results) - 2 * len(BROKEN)


def test_the_first_configuration_is_the_default_build():
    entry = kernels_table()["gemm_kernel"]
    (only,) = config_builds(entry, all_configs=False)
    assert only == (GEMM_CONFIGS[0], entry["constexprs"], {"num_warps": 4, "num_stages": 3}, GEMM_ARGS)
    assert [cx["BLOCK_K"] for _, cx, _, _ in config_builds(entry, all_configs=True)] == [32, 64]
    # The emitter's own per-configuration builds win over the configurations' values.
    entry = {**entry, "builds": [{"constexprs": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},
                                  "options": {"num_warps": 1, "num_stages": 1}}] * 2}
    assert config_builds(entry, all_configs=False)[0][1:3] == ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},
                                                               {"num_warps": 1, "num_stages": 1})


def test_command_line_prints_a_table_and_one_error_line_per_failure(tmp_path):
    """Several modules build in turn, each under its own heading."""
    paths = [tmp_path / "model_triton.py", tmp_path / "other_triton.py"]
    for path in paths:
        path.write_text(module_source())
    done = subprocess.run([sys.executable, "-m", "tilegraph.backends.triton.aot", *map(str, paths), "--targets", "cuda:90"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert sorted(e.split(": ", 2)[2].split(" ")[0] for e in errors) == sorted(list(BROKEN) * 2), done.stderr
    assert "gemm_kernel" in done.stdout and "ptx" in done.stdout
    assert [ln for ln in done.stdout.splitlines() if ln.endswith("_triton.py:")] == [f"{p}:" for p in paths]
    # A module that does not import is one clear error, from the command line and from build(),
    # named among several.
    broken = tmp_path / "broken_triton.py"
    broken.write_text("import triton\nKERNELS = {}\nraise ValueError('emitter bug')\n")
    with pytest.raises(BuildError, match="broken_triton.py does not import: ValueError: emitter bug"):
        build(broken)
    with pytest.raises(BuildError, match="broken_triton.py does not import"):
        build_many([broken, paths[0]])


def test_a_source_string_builds_like_a_file_and_generic_builds_are_said_so():
    source = KERNEL_SOURCE + "\nKERNELS = " + repr({"scale_kernel": kernels_table()["scale_kernel"]}) + "\n"
    (r,) = build(source, targets=("cuda:90",), specialize=False)
    assert (r.kernel, r.target, r.ok, r.specialized) == ("scale_kernel", "cuda:90", True, False)
