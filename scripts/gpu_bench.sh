#!/usr/bin/env bash
# The GPU benchmark on a machine with an NVIDIA GPU (docs/gpu.md), run in a copy of this
# repository there with a bundle `pock gpu bundle` made here. The GPU host needs Python with
# PyTorch (CUDA) and transformers, nothing more: TVM's runtime, the native runner and the other
# wheels travel in the bundle.
#
#   bash scripts/gpu_bench.sh BUNDLE OUT.json [SECONDS]
#
# BUNDLE: the bundle's directory, or a .tar.gz of it. The cases run in groups in order of
# priority, each group only while SECONDS (default 540) last; OUT is rewritten as each phase of
# each case ends, so a run cut short keeps what it finished. Exit 0 even where a case failed:
# OUT says which and why.
set -euo pipefail
bundle=$1 out=$2 budget=${3:-540}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [[ -f $bundle ]]; then
    tar -xzf "$bundle" -C "$scratch"
    bundle=$(find "$scratch" -name cases.json -printf '%h\n' -quit)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$scratch/site" \
    "$bundle"/wheels/*.whl
export PYTHONPATH=$scratch/site:$bundle/runtime:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

group() {  # one `pock gpu bench` call, if more than a minute of the budget is left
    local left=$((budget - SECONDS))
    if ((left < 60)); then
        echo "gpu bench: budget spent, not run: $*"
        return 0
    fi
    timeout -k 10 "$left" python3 -m pipelines.cli gpu bench "$bundle" "$out" --add "$@" ||
        echo "gpu bench: exit $? for: $*"
}

# the sparse vision case beside every PyTorch peer, and the runners on the GPU
group --case mbv2_paper --peers torch_eager_full,torch_eager_frozen,torch_compile_full \
    --case-seconds 150
group --case smollm_paper --case smollm_lora --case-seconds 180
# Qwen2.5-0.5B: its state is 6 GB, too much to write to disk twice per runner in the budget
group --case qwen_paper --case qwen_lora --runner-steps 0 --case-seconds 150
group --case smollm_full --runner-steps 0 --case-seconds 150
group --case qwen_full --case mbv2_full --runner-steps 0 --case-seconds 150
echo "gpu bench: $out written in $SECONDS s"
