#!/usr/bin/env bash
# The nccl tier's checks on a GPU machine (run by hand where one is lent; CI has no GPU): the
# harness's nccl tests, the plugin's nccl items, the CLI's nccl refusal (how long it takes with
# fewer GPUs than the world asks) and a live verify on nccl. Assumes a python3 with a CUDA torch;
# extra wheels (multiprocess, dill) may wait in .whl/ for a machine with no package index.
# Writes its log to ${OUT:-.}/gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-.}/gpu.log
exec > >(tee "$log") 2>&1
[ -d .whl ] && python3 -m pip install --quiet --no-deps --no-index .whl/*.whl
python3 -m pip install --quiet --no-deps --no-build-isolation -e . \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
python3 -m pytest -q -p no:cacheprovider -rs tests/harness/test_run_gloo.py -k nccl
python3 -m pytest -q -p no:cacheprovider -rs tests/test_plugin.py -k nccl
python3 -m pytest -q -p no:cacheprovider -rs tests/cli/test_cli_errors.py tests/checks/test_group_backends.py -k nccl
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
start=$(date +%s%N)
python3 -m meshsim verify torch -n $((gpus + 1)) --backend nccl; echo "exit $?"
echo "refusal took $(( ($(date +%s%N) - start) / 1000000 )) ms"
python3 -m meshsim verify torch -n "$gpus" --backend nccl; echo "exit $?"
python3 -m meshsim verify megatron -n "$gpus" --backend nccl; echo "exit $?"
