"""Hardware descriptions: the datasheet GPUs are self-consistent, the CPU profile is
measured, saved where hardware("cpu") finds it, and reads back exactly."""

import json

import pytest

from tilegraph.ir.errors import TilegraphError
from tilegraph.backends.numpy import calibrate
from tilegraph.ir.calibration import Progress
from tilegraph.passes.cost.hardware import (GPU_TILE_M, GPU_TILE_N, TARGETS, Hardware, clear_cache, cpu_profile_path,
                                  hardware, load_profile, save_profile)
from tilegraph.cli import main as tilegraph_main

GPUS = ("h100", "h200", "a100")
REQUIRED_UFUNCS = ("add", "mul", "div", "exp", "tanh", "sqrt", "maximum", "where", "sum", "erf")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty cache directory, and no CPU profile loaded in this process."""
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path))
    clear_cache()
    yield tmp_path
    clear_cache()


@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_number_is_positive_and_cites_a_source(name):
    hw = hardware(name)
    assert hw.device == "gpu" and hw.name == name
    for value in (hw.memory_bandwidth, hw.cache_bandwidth, hw.cache_bytes, hw.memory_bytes, hw.cores,
                  hw.shared_memory_per_core, hw.shared_memory_per_block, hw.registers_per_core,
                  hw.launch_overhead, *hw.peak_flops.values()):
        assert value > 0
    assert hw.shared_memory_per_block <= hw.shared_memory_per_core
    assert hw.cache_bandwidth > hw.memory_bandwidth  # L2 beats HBM, or fusion for locality means nothing
    assert set(hw.links) == {"nvlink", "infiniband", "pcie"}
    for link in hw.links.values():
        assert 1e-7 < link.alpha < 1e-4 and link.beta > 0 and "http" in link.source
    # NVLink beats PCIe beats the network, per direction.
    assert hw.links["nvlink"].beta > hw.links["pcie"].beta > hw.links["infiniband"].beta
    assert "https://" in hw.source
    assert not hw.gemm_samples and not hw.ufunc_rates  # measured numbers are for the CPU only


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_narrower_types_are_faster(name):
    hw = hardware(name)
    assert hw.flops("f8E4M3FN") > hw.flops("bf16") > hw.flops("tf32") > hw.flops("f32")
    assert hw.flops("f16") == hw.flops("bf16") and hw.flops("i8") == hw.flops("f8E5M2")
    assert "f4E2M1FN" not in hw.peak_flops  # FP4 arrives with Blackwell


def test_h200_is_an_h100_with_more_and_faster_memory():
    h100, h200 = hardware("h100"), hardware("h200")
    assert h200.memory_bandwidth > h100.memory_bandwidth and h200.memory_bytes > h100.memory_bytes
    assert h200.peak_flops == h100.peak_flops and h200.cores == h100.cores
    assert h200.cache_bytes == h100.cache_bytes


def test_a100_has_no_fp8_and_runs_it_at_the_bf16_rate():
    a100 = hardware("a100")
    assert not any(k.startswith("f8") for k in a100.peak_flops)
    assert a100.flops("f8E4M3FN") == a100.flops("bf16")
    assert a100.flops("bf16") < hardware("h100").flops("bf16")


def test_dtypes_without_a_rate_fall_back_to_the_type_they_are_computed_in():
    h100 = hardware("h100")
    assert h100.flops("i32") == h100.flops("i64") == h100.flops("f32")
    assert h100.flops("ui8") == h100.flops("i8")
    assert h100.flops("f4E2M1FN") == h100.flops("f8E4M3FN")


def test_gpu_matmul_runs_at_peak_only_when_whole_tiles_fill_whole_waves():
    hw = hardware("h100")
    peak = hw.flops("bf16")
    full_wave = hw.matmul_rate(GPU_TILE_M * hw.cores, GPU_TILE_N, 4096, "bf16")
    assert full_wave == pytest.approx(peak)
    # One tile of output keeps one SM busy and the rest idle.
    assert hw.matmul_rate(GPU_TILE_M, GPU_TILE_N, 4096, "bf16") == pytest.approx(peak / hw.cores)
    # A ragged edge still occupies a whole tile (tile quantization) ...
    ragged = GPU_TILE_M * hw.cores - GPU_TILE_M // 2
    assert hw.matmul_rate(ragged, GPU_TILE_N, 4096, "bf16") == pytest.approx(peak * ragged / (GPU_TILE_M * hw.cores))
    # ... and one tile past a full wave costs a whole extra wave (wave quantization).
    one_more_tile = hw.matmul_rate(GPU_TILE_M * (hw.cores + 1), GPU_TILE_N, 4096, "bf16")
    assert one_more_tile == pytest.approx(peak * (hw.cores + 1) / (2 * hw.cores))


def test_cpu_matmul_rate_interpolates_the_measured_curve_in_log_size():
    hw = Hardware(
        name="cpu", device="cpu", peak_flops={"f32": 1e11, "f64": 5e10}, memory_bandwidth=1e10,
        cache_bandwidth=1e11, cache_bytes=2**19, memory_bytes=2**34, cores=2, shared_memory_per_core=2**15,
        registers_per_core=0, launch_overhead=1e-6, alloc_overhead=1e-6, links={},
        # Two shapes of equal m*n*k are averaged.
        gemm_samples=((10, 10, 10, 1e9), (100, 100, 100, 1e11), (1000, 100, 10, 5e10)),
    )
    assert hw.matmul_rate(10, 10, 10) == pytest.approx(1e9)
    assert hw.matmul_rate(1, 1, 1) == pytest.approx(1e9)  # clamped below the smallest sample
    assert hw.matmul_rate(10**4, 10**4, 10**4) == pytest.approx(7.5e10)  # and above the largest
    midway = hw.matmul_rate(10, 10, 316)  # m*n*k = 31600 ~ 10^4.5: halfway in log size
    assert midway == pytest.approx((1e9 + 7.5e10) / 2, rel=1e-3)
    assert hw.matmul_rate(100, 100, 100, "f64") == pytest.approx(7.5e10 / 2)
    assert hw.flops("bf16") == hw.flops("f32")  # NumPy computes bf16 in f32


def test_unknown_target_names_the_choices():
    with pytest.raises(TilegraphError) as err:
        hardware("tpu")
    assert "tpu" in str(err.value) and all(t in str(err.value) for t in TARGETS)
    assert hardware(" H100 ") is hardware("h100")


@pytest.mark.parametrize("name", GPUS)
def test_descriptions_round_trip_through_json(name, tmp_path):
    hw = hardware(name)
    path = save_profile(hw, tmp_path / f"{name}.json")
    assert load_profile(path) == hw
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    older = {("kind" if k == "device" else k): v for k, v in hw.to_dict().items()}  # the field's former name
    assert Hardware.from_dict(older) == hw
    assert {hw: 1}[load_profile(path)] == 1  # usable as a dict key
    # no temporary left behind: the profile, and its digest (which the cache checks before reading it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.json", f"{name}.json.sha256"]


def test_first_use_calibrates_quietly_and_saves_a_profile_that_reads_back(cache_dir, capsys):
    path = cpu_profile_path()
    assert path.parent == cache_dir
    path.write_text("{ half a file")  # unreadable: measured again, not an error
    hw = hardware("cpu")
    assert capsys.readouterr().err == ""  # progress only on a terminal
    assert hw.device == "cpu" and "quick" in hw.source
    assert load_profile(path) == hw
    clear_cache()
    assert hardware("cpu") == hw  # read back from the file, not measured again
    assert hardware("cpu") is hardware("cpu")  # loaded once per process

    # The numbers are those of a real machine.
    assert hw.memory_bandwidth < hw.cache_bandwidth
    smallest, largest = hw.gemm_samples[0], hw.gemm_samples[-1]
    assert smallest[0] * smallest[1] * smallest[2] < largest[0] * largest[1] * largest[2]
    # A tiny GEMM is far from peak: a whole call (the fixed cost plus the work at the
    # sample's rate, which is net of that cost) delivers under a quarter of the big one's.
    def delivered(m, n, k, rate):
        return 2 * m * n * k / (hw.launch_overhead + 2 * m * n * k / rate)

    if not hw.measured_busy:  # (a profile taken beside other work is marked so, and measured again later)
        assert delivered(*smallest) < delivered(*largest) / 4
    assert hw.flops("f32") == max(r for *_, r in hw.gemm_samples) * hw.cores  # samples are per core
    assert 1e-9 < hw.launch_overhead < 1e-4 and 0 < hw.alloc_overhead < 1e-3
    assert set(REQUIRED_UFUNCS) <= set(hw.ufunc_rates)
    assert all(rate > 0 for rate in hw.ufunc_rates.values())
    assert hw.ufunc_rates["erf"] < hw.ufunc_rates["add"]  # ~30 NumPy passes against one
    # The same calls over arrays that spill L2, and the kernels timed whole, for every rate.
    assert set(hw.ufunc_rates_spilled) == set(hw.ufunc_rates) and {"gelu", "layer_norm", "softmax"} <= set(
        hw.ufunc_rates)
    assert all(rate > 0 for rate in hw.ufunc_rates_spilled.values())
    assert [d for d, _ in hw.attention_rates] == [32, 64] and all(r > 0 for _, r in hw.attention_rates)
    assert hw.attention_speedup > 0
    assert hw.cores == 1 or hw.blas_call_overhead > 0  # handing BLAS the cores and back is never free
    assert hw.cache_bytes > hw.shared_memory_per_core > 0 and hw.cores >= 1 and hw.memory_bytes > 0


def test_an_unwritable_cache_directory_still_gives_a_measured_profile(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TILEGRAPH_CACHE_DIR", str(tmp_path / "file" / "tilegraph"))  # cannot be created
    clear_cache()
    try:
        hw = hardware("cpu")
    finally:
        clear_cache()
    assert hw.device == "cpu" and hw.gemm_samples and not cpu_profile_path().exists()


def test_calibrate_command_writes_the_profile_hardware_cpu_reads(cache_dir, capsys):
    assert tilegraph_main(["calibrate", "--quick"]) == 0
    out, err = capsys.readouterr()
    path = cpu_profile_path()
    assert f"wrote {path}" in out and "GEMM f32" in out and "stream bandwidth" in out
    assert "calibrating" in err  # the progress bar
    assert hardware("cpu") == load_profile(path)


def test_progress_bar_redraws_in_place_on_a_terminal():
    class Terminal:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

    term = Terminal()
    bar = Progress(2, enabled=True, stream=term)
    bar.step("gemm 16x16x16")
    bar.step("add in cache")
    bar.close()
    assert term.text.count("\r") == 3 and term.text.endswith("\n")
    assert "2/2 add in cache" in term.text and "[" + "#" * Progress.WIDTH + "]" in term.text
