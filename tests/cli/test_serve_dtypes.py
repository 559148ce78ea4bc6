"""What users run, served: a bf16 engine, and FP8 storage from it; online items equal the offline run's bit for bit."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from speculators.train.data import Eagle3SampleFileDataset

from helpers.cli import CPU, conversations, generate, write_jsonl
from speculators_v016.online import OnlineSampleDataset, ProducerClient

COUNT = 6


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("serve-dtype-data") / "chats.jsonl", conversations(COUNT, seed=31))


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"], ids=["bf16", "bf16-fp8"])
def served_and_offline(request, tmp_path_factory, model_dir, data_file):
    """A bf16 service (states stored as the engine's, or FP8) and an offline run with the same settings."""
    storage = ["--dtype", "bfloat16", "--hidden-states-dtype", request.param, "--max-num-seqs", 1]
    out = tmp_path_factory.mktemp(f"serve-dtype-{request.param}") / "out"
    result = generate(model_dir, data_file, out, *storage)
    assert result.exit_code == 0, result.output
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "serve", "--target-model-path", model_dir,
           "--serve-dir", out.parent / "states", "--port", 0, "--seq-length", 256, "--enforce-eager",
           "--train-data-path", data_file, *storage]  # fmt: skip
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **CPU})  # fmt: skip
    url = None
    for line in proc.stdout:
        if line.startswith("serving "):
            url = line.split(" at ", 1)[1].split(": ", 1)[0]
            break
    assert url, proc.communicate(timeout=60)[0]
    yield request.param, url, out
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)


def test_bf16_and_fp8_items_equal_the_offline_files(served_and_offline):
    """Every item of a bf16 service (engine dtype, or FP8 codes and scales) equals upstream's item of the
    offline file, bit for bit."""
    storage, url, out = served_and_offline
    info = ProducerClient(url).info()
    assert info["dtype"] == "bfloat16" and info["hidden_states_dtype"] == storage
    online = OnlineSampleDataset(url, max_len=256, hidden_states_dtype=torch.bfloat16, folder=out.parent / "states")
    files = [str(out / f"data_{i}.safetensors") for i in range(COUNT)]
    offline = Eagle3SampleFileDataset(max_len=256, file_list=files, hidden_states_dtype=torch.bfloat16)
    for i in range(COUNT):
        a, b = online[i], offline[i]
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"sample {i}: {key}"
