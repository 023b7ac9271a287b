"""Device selection and the platform adapters, on CPU: devices are faked by replacing probes,
torch's build facts (torch.version.hip / cuda, torch.cuda.is_available) or torch_xla itself."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import aserve.backends as backends
from aserve.backends import (
    PLATFORMS,
    CpuPlatform,
    CudaPlatform,
    Platform,
    Probe,
    RocmPlatform,
    XlaPlatform,
    current_platform,
    select_platform,
    set_platform,
)

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def fake_devices(monkeypatch, available: set[str]) -> list[str]:
    """Replace every probe; returns the names of the platforms probed, in order."""
    probed: list[str] = []
    for platform in PLATFORMS:
        def probe(name=platform.name) -> Probe:
            probed.append(name)
            return Probe(name in available, f"faked {name} probe")
        monkeypatch.setattr(platform, "probe", staticmethod(probe))
    return probed


@pytest.fixture
def no_current(monkeypatch):
    monkeypatch.setattr(backends, "_current", None)


# --- selection -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("available", "expected"), [
    ({"rocm", "cuda", "xla", "cpu"}, RocmPlatform),
    ({"cuda", "xla", "cpu"}, CudaPlatform),
    ({"xla", "cpu"}, XlaPlatform),
    ({"cpu"}, CpuPlatform),
])
def test_auto_picks_rocm_then_cuda_then_xla_then_cpu(monkeypatch, available, expected):
    fake_devices(monkeypatch, available)
    assert type(select_platform("auto")) is expected
    assert type(select_platform()) is expected


def test_auto_stops_probing_at_the_first_available_platform(monkeypatch):
    probed = fake_devices(monkeypatch, {"cuda", "xla", "cpu"})
    select_platform("auto")
    assert probed == ["rocm", "cuda"]  # the XLA probe (which imports torch_xla) never ran


@pytest.mark.parametrize("name", ["rocm", "cuda", "xla", "cpu"])
def test_explicit_device_is_chosen_over_a_preferred_available_one(monkeypatch, name):
    fake_devices(monkeypatch, {"rocm", "cuda", "xla", "cpu"})
    platform = select_platform(name)
    assert platform.name == name
    assert type(platform) is {p.name: p for p in PLATFORMS}[name]


@pytest.mark.parametrize("name", ["rocm", "cuda", "xla"])
def test_explicit_unavailable_device_raises_with_what_its_probe_found(monkeypatch, name):
    fake_devices(monkeypatch, {"cpu"})
    with pytest.raises(ValueError, match=f"--device {name} is not available: faked {name} probe"):
        select_platform(name)


def test_unknown_device_name_raises_listing_the_choices():
    with pytest.raises(ValueError, match="unknown device 'tpu': expected one of auto, rocm, cuda, "
                                         "xla, cpu"):
        select_platform("tpu")


def test_auto_passes_over_an_available_platform_that_is_not_auto_selectable(monkeypatch):
    probed = fake_devices(monkeypatch, {"cpu"})
    monkeypatch.setattr(XlaPlatform, "probe",
                        staticmethod(lambda: Probe(True, "host-only xla", auto_selectable=False)))
    assert type(select_platform("auto")) is CpuPlatform
    assert probed == ["rocm", "cuda", "cpu"]
    assert type(select_platform("xla")) is XlaPlatform  # an explicit choice takes it


def test_auto_with_only_non_auto_selectable_platforms_says_why(monkeypatch):
    fake_devices(monkeypatch, set())
    monkeypatch.setattr(XlaPlatform, "probe",
                        staticmethod(lambda: Probe(True, "host-only xla", auto_selectable=False)))
    with pytest.raises(ValueError, match="xla: host-only xla"):
        select_platform("auto")


def test_auto_with_nothing_available_reports_every_probe(monkeypatch):
    fake_devices(monkeypatch, set())
    with pytest.raises(ValueError) as error:
        select_platform("auto")
    for name in ("rocm", "cuda", "xla", "cpu"):
        assert f"{name}: faked {name} probe" in str(error.value)


def test_current_platform_selects_auto_once_and_remembers(monkeypatch, no_current):
    probed = fake_devices(monkeypatch, {"cuda", "cpu"})
    first = current_platform()
    assert isinstance(first, CudaPlatform) and current_platform() is first
    assert probed == ["rocm", "cuda"]


def test_set_platform_overrides_the_current_one(monkeypatch, no_current):
    fake_devices(monkeypatch, {"cuda", "cpu"})
    cpu = CpuPlatform()
    assert set_platform(cpu) is cpu and current_platform() is cpu
    assert isinstance(set_platform("cuda"), CudaPlatform)
    assert isinstance(current_platform(), CudaPlatform)


# --- the real probes, on faked torch build facts -------------------------------------------------


def fake_torch_build(monkeypatch, hip: str | None, cuda: str | None, num_gpus: int) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)


def test_rocm_build_with_a_gpu_is_rocm_not_cuda(monkeypatch):
    fake_torch_build(monkeypatch, hip="6.2.41133", cuda=None, num_gpus=2)
    assert RocmPlatform.probe() == Probe(True, "2 ROCm device(s), HIP 6.2.41133")
    assert not CudaPlatform.is_available()
    assert "use --device rocm" in CudaPlatform.probe().detail
    assert type(select_platform("auto")) is RocmPlatform


def test_cuda_build_with_a_gpu_is_cuda_not_rocm(monkeypatch):
    fake_torch_build(monkeypatch, hip=None, cuda="12.4", num_gpus=1)
    assert CudaPlatform.probe() == Probe(True, "1 CUDA device(s), CUDA 12.4")
    assert "not a ROCm build" in RocmPlatform.probe().detail
    assert type(select_platform("auto")) is CudaPlatform


def test_cuda_build_without_a_gpu_says_is_available_is_false(monkeypatch):
    fake_torch_build(monkeypatch, hip=None, cuda="12.4", num_gpus=0)
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        select_platform("cuda")


def test_rocm_build_without_a_gpu_is_not_rocm(monkeypatch):
    fake_torch_build(monkeypatch, hip="6.2", cuda=None, num_gpus=0)
    with pytest.raises(ValueError, match=r"--device rocm is not available: torch.cuda.is_avail"):
        select_platform("rocm")


def test_cpu_only_build_is_not_cuda_and_says_so(monkeypatch):
    fake_torch_build(monkeypatch, hip=None, cuda=None, num_gpus=0)
    assert CudaPlatform.probe().detail.startswith("torch.version.cuda is None")


# --- what each platform says about itself --------------------------------------------------------


@pytest.mark.parametrize(("platform", "dist", "graphs"), [
    (CudaPlatform, "nccl", True),
    (RocmPlatform, "nccl", True),
    (XlaPlatform, "xla", False),
    (CpuPlatform, "gloo", False),
])
def test_platform_facts(platform, dist, graphs):
    assert platform.dist_backend == dist
    assert platform.supports_graphs is graphs
    assert issubclass(platform, Platform)


def test_every_device_name_is_a_platform_name():
    assert backends.DEVICES == ("auto", "rocm", "cuda", "xla", "cpu")


@pytest.mark.parametrize("platform", [CudaPlatform, RocmPlatform])
def test_gpu_rank_owns_the_cuda_device_of_its_local_index(monkeypatch, platform):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert platform().device_for_rank(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=f"local rank 2 has no {platform.name} device: 2 visible"):
        platform().device_for_rank(2)


def test_seed_everything_makes_torch_draws_repeat():
    cpu = CpuPlatform()
    cpu.seed_everything(7)
    first = torch.rand(4)
    cpu.seed_everything(7)
    assert torch.equal(torch.rand(4), first)


# --- XLA, with a fake torch_xla ------------------------------------------------------------------


def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def fake_torch_xla(monkeypatch):
    """A torch_xla of modules in sys.modules; tests set `runtime.device_type` and `xm.*`."""
    xm = fake_module("torch_xla.core.xla_model")
    core = fake_module("torch_xla.core", xla_model=xm)
    runtime = fake_module("torch_xla.runtime", device_type=lambda: "TPU")
    root = fake_module("torch_xla", core=core, runtime=runtime,
                       device=lambda: torch.device("xla", 0))
    for module in (root, core, xm, runtime):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return types.SimpleNamespace(runtime=runtime, xm=xm)


def test_xla_is_available_on_an_accelerator(fake_torch_xla):
    assert XlaPlatform.probe() == Probe(True, "torch_xla PJRT device TPU")


def test_xla_accelerator_is_auto_selectable(fake_torch_xla):
    assert XlaPlatform.probe().auto_selectable


@pytest.mark.parametrize("kind", ["CPU", "cpu"])
def test_xla_on_the_host_cpu_is_available_but_not_auto_selectable(fake_torch_xla, kind):
    fake_torch_xla.runtime.device_type = lambda: kind
    probe = XlaPlatform.probe()
    assert probe.available and not probe.auto_selectable
    assert "PJRT device CPU" in probe.detail and "--device auto" in probe.detail


def test_xla_with_no_pjrt_device_is_not_available(fake_torch_xla):
    fake_torch_xla.runtime.device_type = lambda: None
    probe = XlaPlatform.probe()
    assert not probe.available and "no PJRT device" in probe.detail


def test_explicit_xla_runs_on_the_pjrt_cpu_device(fake_torch_xla):
    fake_torch_xla.runtime.device_type = lambda: "CPU"
    assert type(select_platform("xla")) is XlaPlatform


def test_auto_skips_the_pjrt_cpu_device_for_the_cpu_platform(fake_torch_xla, monkeypatch):
    fake_torch_build(monkeypatch, hip=None, cuda=None, num_gpus=0)
    fake_torch_xla.runtime.device_type = lambda: "CPU"
    assert type(select_platform("auto")) is CpuPlatform
    fake_torch_xla.runtime.device_type = lambda: "TPU"
    assert type(select_platform("auto")) is XlaPlatform


def test_xla_probe_reports_a_torch_xla_that_fails_to_import(fake_torch_xla, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla.runtime", None)  # makes the import raise
    probe = XlaPlatform.probe()
    assert not probe.available and probe.detail.startswith("torch_xla failed to load: ")


def test_xla_probe_without_torch_xla_installed(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert XlaPlatform.probe() == Probe(False, "torch_xla is not installed")


def test_xla_rank_device_is_the_one_the_runtime_assigned(fake_torch_xla):
    assert XlaPlatform().device_for_rank(3) == torch.device("xla", 0)


@pytest.mark.parametrize("info", [
    {"bytes_used": 4 * GiB, "bytes_limit": 16 * GiB},
    {"kb_free": 12 * GiB // 1024, "kb_total": 16 * GiB // 1024},
])
def test_xla_mem_info_reads_both_torch_xla_formats(fake_torch_xla, info):
    fake_torch_xla.xm.get_memory_info = lambda device: info
    assert XlaPlatform().mem_info(torch.device("xla", 0)) == (12 * GiB, 16 * GiB)


def test_xla_mem_info_without_get_memory_info_says_how_to_size_the_cache(fake_torch_xla):
    with pytest.raises(RuntimeError, match="--kv-cache-memory"):
        XlaPlatform().mem_info()


def test_xla_on_the_host_cpu_reads_host_memory_and_budgets_the_kv_cache_like_cpu(
        fake_torch_xla, tmp_path):
    fake_torch_xla.runtime.device_type = lambda: "CPU"
    meminfo = write_meminfo(tmp_path / "meminfo", 64 * GiB // 1024, 3 * GiB // 1024)
    xla = XlaPlatform(host=CpuPlatform(meminfo, tmp_path / "no-cgroup"))
    assert xla.mem_info(torch.device("xla", 0)) == (3 * GiB, 64 * GiB)
    assert xla.default_kv_cache_bytes() == 3 * GiB // 2


def test_xla_mark_step_cuts_the_graph_with_torch_xla_sync(fake_torch_xla, monkeypatch):
    calls = []
    monkeypatch.setattr(sys.modules["torch_xla"], "sync", lambda: calls.append("sync"),
                        raising=False)
    fake_torch_xla.xm.wait_device_ops = lambda: calls.append("wait")
    XlaPlatform().mark_step()
    XlaPlatform().synchronize()
    assert calls == ["sync", "sync", "wait"]


def test_random_draws_for_xla_are_made_on_the_host_and_elsewhere_on_the_device():
    assert XlaPlatform().generator_device(torch.device("xla", 0)) == torch.device("cpu")
    assert CudaPlatform().generator_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert CpuPlatform().generator_device(torch.device("cpu")) == torch.device("cpu")


def test_eager_platforms_have_no_graph_to_cut():
    assert CpuPlatform().mark_step() is None


@pytest.mark.spawns
def test_importing_backends_or_selecting_cpu_does_not_import_torch_xla(tmp_path):
    """In a fresh interpreter where a (fake) torch_xla is importable; the probe proves it is."""
    package = tmp_path / "torch_xla"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "runtime.py").write_text("def device_type():\n    return 'TPU'\n")
    script = textwrap.dedent("""
        import sys
        import aserve.backends as backends
        after_import = "torch_xla" in sys.modules
        backends.select_platform("cpu")
        after_cpu = "torch_xla" in sys.modules
        backends.XlaPlatform.probe()
        print(after_import, after_cpu, "torch_xla" in sys.modules)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", "False", "True"]


# --- CPU memory ----------------------------------------------------------------------------------


def write_meminfo(path: Path, total_kib: int, available_kib: int) -> Path:
    path.write_text(f"MemTotal:       {total_kib} kB\nMemFree:         1024 kB\n"
                    f"MemAvailable:   {available_kib} kB\nHugePages_Total:       0\n")
    return path


def write_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cpu_mem_info_of_this_machine_is_positive_with_free_at_most_total():
    free, total = CpuPlatform().mem_info(torch.device("cpu"))
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total


def test_cpu_mem_info_reads_meminfo_in_bytes(tmp_path):
    meminfo = write_meminfo(tmp_path / "meminfo", total_kib=32 * GiB // 1024,
                            available_kib=20 * GiB // 1024)
    cpu = CpuPlatform(meminfo=meminfo, cgroup=tmp_path / "no-cgroup")
    assert cpu.mem_info() == (20 * GiB, 32 * GiB)


def test_cpu_mem_info_is_capped_by_a_cgroup_v2_limit(tmp_path):
    meminfo = write_meminfo(tmp_path / "meminfo", 64 * GiB // 1024, 60 * GiB // 1024)
    cgroup = write_files(tmp_path / "cg", {
        "memory.max": f"{8 * GiB}\n", "memory.current": f"{3 * GiB}\n",
        "memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}\n"})
    # usage less the reclaimable page cache: 8 GiB - (3 - 1) GiB
    assert CpuPlatform(meminfo, cgroup).mem_info() == (6 * GiB, 8 * GiB)


def test_cpu_mem_info_is_capped_by_a_cgroup_v1_limit(tmp_path):
    meminfo = write_meminfo(tmp_path / "meminfo", 64 * GiB // 1024, 60 * GiB // 1024)
    cgroup = write_files(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": f"{4 * GiB}\n",
        "memory/memory.usage_in_bytes": f"{GiB}\n",
        "memory/memory.stat": f"inactive_file 7\ntotal_inactive_file {GiB // 2}\n"})
    assert CpuPlatform(meminfo, cgroup).mem_info() == (4 * GiB - GiB // 2, 4 * GiB)


@pytest.mark.parametrize("files", [
    {"memory.max": "max\n", "memory.current": f"{GiB}\n"},
    {"memory/memory.limit_in_bytes": "9223372036854771712\n",
     "memory/memory.usage_in_bytes": f"{GiB}\n"},
])
def test_cpu_mem_info_ignores_an_unlimited_cgroup(tmp_path, files):
    meminfo = write_meminfo(tmp_path / "meminfo", 16 * GiB // 1024, 10 * GiB // 1024)
    cgroup = write_files(tmp_path / "cg", files)
    assert CpuPlatform(meminfo, cgroup).mem_info() == (10 * GiB, 16 * GiB)


def test_cpu_mem_info_falls_back_to_sysconf_without_proc(tmp_path):
    free, total = CpuPlatform(tmp_path / "missing", tmp_path / "missing-cg").mem_info()
    page = os.sysconf("SC_PAGE_SIZE")
    assert total == os.sysconf("SC_PHYS_PAGES") * page
    assert 0 < free <= total


@pytest.mark.parametrize(("available", "expected"), [(60 * GiB, 2 * GiB), (2 * GiB, GiB)])
def test_cpu_default_kv_cache_is_2gib_or_half_the_available_memory(tmp_path, available,
                                                                   expected):
    meminfo = write_meminfo(tmp_path / "meminfo", 64 * GiB // 1024, available // 1024)
    assert CpuPlatform(meminfo, tmp_path / "cg").default_kv_cache_bytes() == expected


def test_gpu_platforms_size_the_kv_cache_by_profiling(fake_torch_xla):
    assert CudaPlatform().default_kv_cache_bytes() is None
    assert XlaPlatform().default_kv_cache_bytes() is None  # on a TPU


@pytest.mark.parametrize("local_rank", [0, 3])
def test_every_cpu_rank_runs_on_the_cpu_device(local_rank):
    assert CpuPlatform().device_for_rank(local_rank) == torch.device("cpu")


# --- kernel selection: one KernelOps per (platform, dtype) -----------------------------------


def test_cpu_kernel_selection_by_dtype(cpu_elementwise_kernels):
    from aserve.backends import cpu_ops
    from aserve.backends.cpu_block import CpuDecoderBlock, CpuDecoderStack
    from aserve.backends.ops import REF_OPS, fused_moe_ref_fn
    from aserve.kernels import cpu_elementwise, cpu_gemm
    from aserve.kernels.cpu_attention import cpu_attention_forward
    from aserve.kernels.paged_attention_cpu import paged_attention_cpu

    platform = CpuPlatform()
    fp32, bf16, fp16 = (platform.kernel_ops(d) for d in (torch.float32, torch.bfloat16,
                                                          torch.float16))
    # float32: the references (bit-equal to transformers), C++ argmax (exact)
    for op in ("store_kv", "paged_attention", "rms_norm", "rope", "silu_and_mul",
               "gelu_tanh_and_mul"):
        assert getattr(fp32, op) is getattr(REF_OPS, op), op
    assert fp32.attention_forward is None and fp32.pack_linears is None
    assert fp32.decoder_layer is None and fp32.decoder_stack is None
    assert fp32.argmax is cpu_elementwise.argmax
    # bfloat16: the C++ kernels, packed GEMMs, the whole layer as one call
    assert (bf16.rms_norm, bf16.rope, bf16.silu_and_mul, bf16.gelu_tanh_and_mul) == (
        cpu_ops.rms_norm, cpu_ops.rope, cpu_ops.silu_and_mul, cpu_ops.gelu_tanh_and_mul)
    assert bf16.attention_forward is cpu_attention_forward
    assert bf16.pack_linears is not None and bf16.decoder_layer == CpuDecoderBlock.of
    assert bf16.decoder_stack == CpuDecoderStack.of
    # float16: C++ decode attention, references for the rest
    assert fp16.paged_attention is paged_attention_cpu
    assert fp16.attention_forward is cpu_attention_forward
    assert fp16.rms_norm is REF_OPS.rms_norm and fp16.pack_linears is None
    assert fp16.gelu_tanh_and_mul is REF_OPS.gelu_tanh_and_mul
    # fused MoE: aserve's GEMM for bf16 where it is built, the reference for the others
    assert fp32.fused_moe is fused_moe_ref_fn and fp16.fused_moe is fused_moe_ref_fn
    assert bf16.fused_moe is (cpu_ops.fused_moe if cpu_gemm.available() else fused_moe_ref_fn)
    assert platform.kernel_ops(torch.bfloat16) is bf16  # chosen once per dtype


def test_gpu_and_xla_kernel_selection_by_dtype():
    from aserve.backends import triton_ops
    from aserve.backends.ops import REF_OPS, fused_moe_ref_fn
    from aserve.kernels.paged_attention_triton import paged_attention_triton
    from aserve.kernels.store_kv import store_kv_triton

    for platform in (CudaPlatform(), RocmPlatform()):  # choosing touches no device
        for dtype in (torch.bfloat16, torch.float16):
            ops = platform.kernel_ops(dtype)
            assert (ops.rms_norm, ops.rope) == (triton_ops.rms_norm, triton_ops.rope)
            assert ops.paged_attention is paged_attention_triton
            assert ops.store_kv is store_kv_triton
            assert ops.gelu_tanh_and_mul is REF_OPS.gelu_tanh_and_mul  # torch
            assert ops.fused_moe is triton_ops.fused_moe
        fp32 = platform.kernel_ops(torch.float32)
        assert fp32.paged_attention is paged_attention_triton
        assert fp32.rms_norm is REF_OPS.rms_norm and fp32.pack_linears is None
        assert fp32.fused_moe is triton_ops.fused_moe
    assert XlaPlatform().kernel_ops(torch.bfloat16) is REF_OPS
    assert REF_OPS.fused_moe is fused_moe_ref_fn


def test_triton_fused_moe_takes_strided_expert_weights_and_matches_the_reference():
    """The factory makes the weights contiguous once; the kernel runs under the Triton
    interpreter here (conftest.py), on the GPU where there is one."""
    pytest.importorskip("triton")
    from aserve.backends import triton_ops
    from aserve.backends.ops import ExpertWeights, fused_moe_ref_fn
    from aserve.kernels.fused_moe_triton import _gate_up_kernel
    from aserve.kernels.triton_utils import is_interpreted

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not is_interpreted(_gate_up_kernel):
        pytest.skip("no GPU, and the kernels were decorated before TRITON_INTERPRET=1 was set")
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 32, 24, generator=gen).transpose(1, 2) / 5  # [E, 2I=24, H=32], strided
    w2 = torch.randn(4, 12, 32, generator=gen).transpose(1, 2) / 4  # [E, H=32, I=12]
    bias = torch.randn(4, 24, generator=gen)
    expert_map = torch.tensor([2, -1, 0, 1, -1, 3], dtype=torch.int32)
    x = torch.randn(5, 32, generator=gen)
    weights = torch.softmax(torch.randn(5, 2, generator=gen), dim=-1)
    ids = torch.tensor([[0, 1], [2, 3], [5, 4], [1, 4], [3, 0]])
    experts = ExpertWeights(w13.to(device), w2.to(device), w13_bias=bias.to(device),
                            activation="swiglu_oai", limit=0.5, expert_map=expert_map.to(device))
    run = triton_ops.fused_moe(experts)
    got = run(x.to(device), weights.to(device), ids.to(device))
    want = fused_moe_ref_fn(ExpertWeights(w13, w2, w13_bias=bias, activation="swiglu_oai",
                                          limit=0.5, expert_map=expert_map))(x, weights, ids)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.all(got[3] == 0)  # both of token 3's experts are another rank's


def test_cpu_wrappers_send_what_their_kernel_does_not_take_to_the_reference(
        cpu_elementwise_kernels):
    from aserve.backends import cpu_ops
    from aserve.backends.ops import gelu_tanh_and_mul_ref
    from aserve.kernels.rms_norm import rms_norm_ref
    from aserve.kernels.rotary import rotary_ref

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 64, generator=gen).bfloat16().transpose(0, 1)  # not contiguous
    w = torch.randn(64, generator=gen).bfloat16()
    got, want = x.clone(), x.clone()  # clones keep the strides
    assert not got.is_contiguous()
    cpu_ops.rms_norm(got, w, 1e-6)
    rms_norm_ref(want, w, 1e-6)
    assert torch.equal(got, want)
    cos = torch.randn(32, 64, generator=gen).bfloat16()
    sin = torch.randn(32, 64, generator=gen).bfloat16()
    q = torch.randn(5, 128, generator=gen).bfloat16()
    k = torch.randn(5, 64, generator=gen).bfloat16()
    positions = torch.arange(5, dtype=torch.int32)  # the C++ kernel takes int64 only
    got_q, got_k, want_q, want_k = q.clone(), k.clone(), q.clone(), k.clone()
    cpu_ops.rope(positions, got_q, got_k, cos, sin, 64, 64)
    rotary_ref(positions, want_q, want_k, cos, sin, 64, 64)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    gate_up = torch.randn(5, 2, 2 * 64, generator=gen).bfloat16().transpose(0, 1)
    assert torch.equal(cpu_ops.gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_ref(gate_up))


def test_cpu_fused_moe_packs_the_experts_its_kernel_takes_and_leaves_the_rest_to_the_reference(
        cpu_gemm_kernel):
    from aserve.backends import cpu_ops
    from aserve.backends.ops import ExpertWeights
    from aserve.kernels.cpu_moe import CpuFusedMoE
    from aserve.kernels.moe import fused_moe_ref

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (0.1 * torch.randn(*shape, generator=gen)).bfloat16()

    x, weights = randn(5, 64), torch.rand(5, 2, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
    taken = ExpertWeights(randn(4, 96, 64), randn(4, 64, 48), activation="gelu_tanh")
    assert isinstance(cpu_ops.fused_moe(taken), CpuFusedMoE)
    odd_i = ExpertWeights(randn(4, 90, 64), randn(4, 64, 45))  # the down GEMM's K is odd
    fp32 = ExpertWeights(randn(4, 96, 64).float(), randn(4, 64, 48).float())
    for w in (odd_i, fp32):
        fn = cpu_ops.fused_moe(w)
        assert not isinstance(fn, CpuFusedMoE)
        xw = x.to(w.w13.dtype)
        assert torch.equal(fn(xw, weights, ids), fused_moe_ref(xw, w.w13, w.w2, weights, ids))


def test_gated_activation_layers_run_their_bound_ops():
    from dataclasses import replace

    from aserve.backends.ops import REF_OPS
    from aserve.layers import GeluTanhAndMul, SiluAndMul, bind_ops

    x = torch.randn(3, 8)
    gelu, silu = GeluTanhAndMul(), SiluAndMul()
    gate, up = x.chunk(2, dim=-1)  # unbound: the references, bit-equal to HF's float32
    assert torch.equal(gelu(x), torch.nn.functional.gelu(gate, approximate="tanh") * up)
    assert torch.equal(silu(x), torch.nn.functional.silu(gate) * up)
    marked = replace(REF_OPS, name="marked", gelu_tanh_and_mul=lambda t: t[..., :1],
                     silu_and_mul=lambda t: t[..., 1:2])
    model = torch.nn.Sequential(gelu, silu)
    bind_ops(model, marked)
    assert torch.equal(gelu(x), x[..., :1]) and torch.equal(silu(x), x[..., 1:2])
