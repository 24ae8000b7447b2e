"""The GPU benchmark's two halves (docs/gpu.md), on this machine:

- `pock gpu bundle` compiles ``experiment=gpu``'s cases for a profile into a bundle; here a
  tiny SmolLM-architecture LoRA case for the host (a 3-layer speed build, a 2-layer parity
  build), leaving out TVM's runtime and the wheels;
- `pock gpu bench` runs the bundle with TVM's runtime library alone (``TVM_USE_RUNTIME_LIB=1``,
  as on a GPU host without the compiler): the compiled step matches PyTorch over three chained
  steps (losses 1e-4 relative, every tensor rtol 1e-4, frozen weights bit-identical, the same
  set trained), and is timed beside its peers, with the metrics a GPU run writes; the bundle's
  native runner and the Python runner give the same weights;
- the nvidia_hopper profile builds a causal LM's step with nvcc for sm_90, the embedding's
  gradient (take_backward) and the fused cross-entropy by their own GPU kernels
  (pipelines/kernels/take_backward_gpu.py, softmax_nll_gpu.py), its matrix products on
  cuBLAS (pipelines/backend/cublas_sgemm.cc), and the kernels that read only the step's state
  captured into CUDA graphs.

Without a GPU here the CUDA step is built, not run: docs/gpu.md says how to run it on one.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pipelines.io import ROOT

pytestmark = pytest.mark.slow

TINY = [f"+models.smollm.config.{k}={v}" for k, v in
        {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 256}.items()] + ["models.smollm.dims.sequence=16"]
ONLY_LORA = ["~cases.mbv2_full", "~cases.mbv2_paper", "~cases.smollm_full",
             "~cases.smollm_paper", "~cases.qwen_paper", "~cases.qwen_lora", "~cases.qwen_full"]


def _pock(*args, env=None):
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "bundle"
    _pock("bundle", "--profile", "host", "--no-runtime", "--out", str(out), *TINY, *ONLY_LORA)
    return out


def test_bundle_holds_a_speed_and_a_parity_build_per_case(bundle):
    cases = json.loads((bundle / "cases.json").read_text())
    assert list(cases) == ["smollm_lora"]
    case = cases["smollm_lora"]
    assert case["builds"] == {"speed": "cases/smollm_lora/speed",
                              "parity": "cases/smollm_lora/parity"}
    assert case["models"]["parity"]["config"]["num_hidden_layers"] == 2
    assert case["report"]["pruned"]["flops"] < case["report"]["full"]["flops"]
    for role in ("speed", "parity"):  # the adapters travel; the weights are made there
        assert (bundle / case["builds"][role] / "extra.safetensors").stat().st_size < 100_000


def test_bench_runs_the_bundle_on_tvms_runtime_alone(bundle, tmp_path):
    out = tmp_path / "gpu.json"
    _pock("bench", str(bundle), str(out), "--steps", "2", "--rounds", "1", "--min-seconds", "0",
          "--warmup", "1", "--cores", "1", "--runner-steps", "4",
          env={"TVM_USE_RUNTIME_LIB": "1"})
    result = json.loads(out.read_text())
    assert result["machine"]["device"] == "cpu"  # no GPU here: the CPU build ran
    parity = result["smollm_lora"]["parity"]
    assert parity["chained"] and parity["steps"] == 3 and parity["matches"], parity
    assert parity["frozen_bit_identical"] and parity["trained_set_equal"]
    assert parity["trained"] == 8 and parity["frozen"] > 0  # q and v adapters of 2 layers
    speed = result["smollm_lora"]["speed"]
    assert set(speed) >= {"compiled", "torch_eager_full", "torch_eager_frozen",
                          "speedup_vs_torch_eager_full", "sgemm_peak_gflop_per_s"}
    assert speed["compiled"]["tokens_per_s"] > 0
    # the bundle's native runner and the Python runner: the same steps, the same weights
    runners = result["smollm_lora"]["runners"]
    assert runners["steps"] == 4 and runners["device"] == "cpu", runners
    assert runners["losses_equal"] and runners["weights_bit_identical"], runners
    assert runners["weights_max_abs_difference"] == 0
    assert 0 < runners["native"]["peak_rss_bytes"] < runners["python"]["peak_rss_bytes"]


def test_hopper_build_compiles_a_causal_lm_with_nvcc(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH (Debian package nvidia-cuda-toolkit)")
    from conftest import compose_params

    from pipelines.compile import compile
    from pipelines.config import case_optimizer
    from pipelines.profiles import load_profile

    params = compose_params("experiment=gpu", *TINY)
    spec = params.cases["smollm_full"]
    built = compile(params.models["smollm"], params.schemes["full"].rules,
                    case_optimizer(params, spec), load_profile("nvidia_hopper", {}),
                    tmp_path).built
    assert built["cuda"]["arch"] == "sm_90" and built["cuda"]["fatbin_bytes"] > 0
    assert built["kernel_schedules"]["take_backward_gpu"] == 1
    assert built["kernel_schedules"]["softmax_nll_loss_gpu"] == 1  # not one thread (Fallback)
    # the kernels that read only the resident state replay as CUDA graphs: only those that
    # read the batch (the embedding, the loss) launch one by one
    launches = built["kernel_launches"]
    assert built["cuda_graph"] and launches["cuda_graphs"] >= 1, launches
    assert launches["launched"] < launches["in_cuda_graphs"] / 10, launches
    # every float32 product on cuBLAS (the profile's gemm_library): no product left for
    # dlight's Matmul rule, the shim's functions among the library's exports
    products = built["backends"]["kernels"]
    assert {row["transposed"] for row in products.values()} == {"nn", "nt", "tn"}
    assert {row["backend"] for row in products.values()} == {"cublas"}
    assert "Matmul" not in built["kernel_schedules"]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "step.so")],
                              capture_output=True, text=True, check=True).stdout
    assert all(f"__tvm_ffi_pockengine_cublas_sgemm_{xy}" in exported
               for xy in ("nn", "nt", "tn", "tt"))
