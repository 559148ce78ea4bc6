"""Upstream speculators 0.9.0's released online client against our service (run by test_serve_peer.py).

Runs in its own venv (speculators 0.9.0, hs-connectors 0.9.0), never ours:
``python peer_client_090.py URL MODEL REQUESTS.json OUT_DIR``. For each token-id
list of REQUESTS.json: upstream's ``generate_hidden_states`` asks the server, its
``FileTransfer`` reads the file, its ``check_hidden_states`` validates it, and
``FileTransfer.delete`` removes it; then upstream's training dataset
(``ArrowDataset``, ``on_missing="generate"``) gives item 0 of the same samples.
What they returned is saved to OUT_DIR as safetensors for the test to compare.
"""

import json
import os
import sys
from pathlib import Path

import openai
from datasets import Dataset
from hs_connectors import FileTransfer
from safetensors.torch import save_file
from speculators.data_generation.offline import check_hidden_states
from speculators.data_generation.vllm_client import generate_hidden_states
from speculators.train.data import ArrowDataset


def main(url: str, model: str, requests_file: str, out_dir: str) -> None:
    out = Path(out_dir)
    samples = json.loads(Path(requests_file).read_text())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    transfer = FileTransfer(out / "unused")
    for i, sample in enumerate(samples):
        handle, params = generate_hidden_states(client, model, {"input_ids": sample["input_ids"]}, timeout=120)
        states = transfer.get_generated(params)
        check_hidden_states(states, sample["input_ids"])
        save_file({k: v.contiguous() for k, v in states.items()}, str(out / f"generated_{i}.safetensors"))
        transfer.delete(handle)
        assert not os.path.exists(handle), handle
    rows = {k: [s[k] for s in samples] for k in ("input_ids", "loss_mask")}
    rows["seq_len"] = [len(s["input_ids"]) for s in samples]
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out / "arrow"))
    dataset = ArrowDataset(max_len=256, datapath=str(out / "arrow"), vllm_endpoint=f"{url}/v1",
                           on_missing="generate", model=model, request_timeout=120)  # fmt: skip
    item = dataset[0]
    save_file({k: v.contiguous() for k, v in item.items() if hasattr(v, "shape")}, str(out / "item_0.safetensors"))
    print(json.dumps({"approx_lengths": list(dataset.approx_lengths), "len": len(dataset)}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
