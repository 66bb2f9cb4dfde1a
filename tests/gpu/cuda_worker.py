"""A worker that first proves its GPU is real and its own: it records what CUDA and NVML show this
step (device count, name, UUID, a matrix product's result), then runs the drain-aware fake worker."""

import json
import os
import runpy
import time
from pathlib import Path

import pynvml
import torch

seen: dict[str, object] = {"worker": os.environ.get("SLURM_ELASTIC_WORKER_ID", "?"), "event": "cuda",
                           "t": time.time(), "step_gpus": os.environ.get("SLURM_STEP_GPUS"),
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "torch_devices": torch.cuda.device_count()}
if torch.cuda.device_count():
    ones = torch.ones(1024, 1024, device="cuda")
    seen["matmul"] = float((ones @ ones)[0, 0])
    seen["name"] = torch.cuda.get_device_name(0)
pynvml.nvmlInit()
seen["nvml_uuids"] = [str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                      for i in range(pynvml.nvmlDeviceGetCount())]
with open(os.environ["FAKE_WORKER_LOG"], "a") as log:
    log.write(json.dumps(seen) + "\n")
runpy.run_path(str(Path(__file__).resolve().parents[1] / "cluster" / "fake_worker.py"), run_name="__main__")
