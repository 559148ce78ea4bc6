"""`speculators-data-gen serve` and OnlineSampleDataset, both real: items equal an offline run's, bounds, faults;
and upstream 0.9.0's released client (its own venv, installed here) served by the same service.

One service (the real command, CPU vLLM, eager, fp32) serves the module; an
offline run of the same dataset with the same engine settings is the
reference. Both run one sequence per step (--max-num-seqs 1): vLLM's CPU
kernels are not batch-invariant, so only equal batches give equal bits.
"""

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from speculators.train.data import Eagle3SampleFileDataset

from helpers import ZERO_TOKEN, peer_venv
from helpers.cli import CPU, conversations, generate, write_jsonl
from speculators_v016.online import OnlineSampleDataset, ProducerClient, ProducerError
from speculators_v016.online.client import API_KEY_VARIABLE
from speculators_v016.online.readers import SERVE_DIR_VARIABLE, MooncakeReader
from speculators_v016.serve.folder import JOURNAL, LOCK
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT

COUNT = 12
SERVE_ENV = {**CPU, "SPECULATORS_DATA_GEN_NO_PROGRESS": "1"}
API_KEY = "test-key-of-the-mooncake-service"
CAP = 1 << 20  # --max-published-bytes: about two of the largest samples (fp32, 4 layers of 128, 256 tokens)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("serve-data") / "chats.jsonl", conversations(COUNT, seed=21))


@pytest.fixture(scope="module")
def offline(tmp_path_factory, model_dir, data_file):
    out = tmp_path_factory.mktemp("serve-offline") / "out"
    result = generate(model_dir, data_file, out, "--max-num-seqs", 1, "--token-freq-path", out.parent / "tf.pt")
    assert result.exit_code == 0, result.output
    return out


def start_service(model_dir, serve_dir, *extra, data_file=None, fault=None):
    """The real `serve` command; returns (process, url) once it listens (or the process, ended, and None).
    ``serve_dir`` None: the Mooncake backend, its master started by the service; ``fault``: injected."""
    where = ["--serve-dir", serve_dir] if serve_dir is not None else ["--backend", "mooncake"]
    module = "speculators_v016.testing.faults" if fault else "speculators_v016.run.cli"
    cmd = [sys.executable, "-m", module, "serve", "--target-model-path", model_dir,
           *where, "--port", 0, "--seq-length", 256, "--enforce-eager", "--dtype", "float32",
           "--max-num-seqs", 1, "--max-published-bytes", CAP, *(["--train-data-path", data_file] if data_file else []),
           *extra]  # fmt: skip
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **SERVE_ENV, **({FAULT: fault} if fault else {})})  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving "):
            return proc, re.search(r" at (http://[\d.]+:\d+): ", line).group(1), lines
    proc.wait(timeout=60)
    return proc, None, lines


def stop_service(proc) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, rest


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_dir, data_file):
    serve_dir = tmp_path_factory.mktemp("serve") / "states"
    proc, url, lines = start_service(model_dir, serve_dir, data_file=data_file)
    assert url, "".join(lines)
    yield {"url": url, "dir": serve_dir, "proc": proc, "start": "".join(lines)}
    stop_service(proc)


def offline_items(offline, indices):
    files = [str(offline / f"data_{i}.safetensors") for i in indices]
    return Eagle3SampleFileDataset(max_len=256, file_list=files)


def assert_same_item(a: dict, b: dict, where: str) -> None:
    assert sorted(a) == sorted(b), where
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{where}: {key} differs"


def published(serve_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(serve_dir) if n.startswith("online_"))


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("shift-check:2", "does not reproduce vLLM's own prompt logprobs"),
        ("zero-states:1", "layer 2: every value is 0. No model produces this"),
    ],
)
def test_a_failing_self_check_stops_the_service_and_nothing_is_published(
    model_dir, data_file, tmp_path, fault, message
):
    """States shifted by a row (the logit check) or all zero (the screen): every client is told, nothing is
    published, the service exits 7 naming the sample."""
    serve_dir = tmp_path / "states"
    proc, url, lines = start_service(model_dir, serve_dir, "--layer-ids", "2 4 5 7", data_file=data_file, fault=fault)
    assert url, "".join(lines)
    client = ProducerClient(url, retries=0)
    errors = []

    def ask(i):
        try:
            client.request(f"sample {i}", index=i)
        except ProducerError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    code, rest = stop_service(proc)
    assert code == 7, rest
    assert len(errors) == 6 and all(f"the producer {url}" in e for e in errors), errors
    assert any(message in e for e in errors), errors
    assert re.search(r"error: the service's engine failed: SelfCheckError: self-check failed: sample \d+", rest), rest
    assert published(serve_dir) == []


def test_nan_states_made_in_the_forward_refuse_that_sample_alone(model_dir, data_file, tmp_path):
    """A NaN planted in the first step's aux states (the forward "made" it): that sample is refused to its client
    naming its layers, the next ones are served, and /v1/info counts every sample as tested by the publishers."""
    serve_dir = tmp_path / "states"
    proc, url, lines = start_service(
        model_dir, serve_dir, "--logit-check-samples", 0, data_file=data_file, fault="nan-step:1"
    )
    assert url, "".join(lines)
    try:
        client = ProducerClient(url, retries=0)
        with pytest.raises(ProducerError) as caught:
            client.request("sample 0", index=0)
        assert re.search(r"NaN/Inf hidden states in layers \[[\d, ]+\]: not published", str(caught.value)), caught.value
        for i in (1, 2):
            client.request(f"sample {i}", index=i)
        info = client.info()
        assert (info["served"], info["finite_proven"], info["finite_tested"]) == (2, 0, 3), info
        assert info["failure"] is None, info
        assert len(published(serve_dir)) == 2  # the refused sample's file was never made
    finally:
        code, rest = stop_service(proc)
    assert code == 0, rest


def test_a_zero_embedding_token_is_served_and_one_broken_sample_is_refused_not_fatal(zero_embedding_model, tmp_path):
    """A request starting with a token whose embedding row is zero (exact-zero states at position 0) is served; a
    sample whose capture failed once (all zero) is refused to its client alone, counted, and the service goes on."""
    proc, url, lines = start_service(zero_embedding_model, tmp_path / "states", fault="zero-sample:2")
    assert url, "".join(lines)
    try:
        rows = [([ZERO_TOKEN, *range(30 + i, 70 + i)], [1] * 41) for i in range(3)]
        ds = OnlineSampleDataset(url, max_len=256, samples=rows, retries=0, folder=tmp_path / "states")
        assert ds[0]["input_ids"].tolist() == rows[0][0][1:]  # upstream shifts by one
        with pytest.raises(ProducerError) as caught:
            ds[1]
        assert re.search(
            rf"^sample 1: the producer {url} refused the request: not published: its states hold rows no model "
            r"produces \(sample 1, layer \d+: rows \[1, 2, [\d, .]+\] \(40 of 41\) are all 0\); the service goes on "
            r"\(1 samples refused so far",
            str(caught.value),
        ), caught.value
        assert ds[2]["input_ids"].tolist() == rows[2][0][1:]
        info = ProducerClient(url).info()
        assert (info["served"], info["screened"], info["failure"]) == (2, 1, None), info
    finally:
        code, rest = stop_service(proc)
    assert code == 0, rest
    assert "request 1 refused, its states hold rows no model produces (1 in a row)" in "".join(lines) + rest


def test_start_line_and_info_name_the_model_layers_and_dataset(service, model_dir, offline):
    """The start line names address, layers and folder; /v1/info gives the dataset's token counts before anything runs."""
    assert f"serving {model_dir} at {service['url']}: layers [2, 4, 5, 7], float32, {COUNT} samples" in service["start"]
    info = ProducerClient(service["url"]).info()
    assert info["num_samples"] == COUNT and info["backend"] == {
        "kind": "folder",
        "dir": str(service["dir"]),
        "service": json.loads((service["dir"] / JOURNAL).read_text().splitlines()[0])["service"],
    }
    assert info["lengths"] == [len(load_sample(offline / f"data_{i}.safetensors")["input_ids"]) for i in range(COUNT)]


def test_online_items_equal_upstream_dataset_on_offline_files_bit_for_bit(service, offline):
    """Every online item equals upstream's Eagle3SampleFileDataset item of the offline file, bit for bit; files taken."""
    online = OnlineSampleDataset(service["url"], max_len=256, folder=service["dir"])
    assert len(online) == COUNT and online.approx_lengths == ProducerClient(service["url"]).info()["lengths"]
    reference = offline_items(offline, range(COUNT))
    for i in range(COUNT):
        assert_same_item(online[i], reference[i], f"sample {i}")
    assert online.requests == COUNT
    assert published(service["dir"]) == []  # each file deleted once read


def test_concurrent_clients_each_get_their_own_samples(service, offline):
    """Eight threads asking at once (every sample twice, out of order) each get the sample they asked for."""
    online = OnlineSampleDataset(service["url"], max_len=256, folder=service["dir"])
    order = [i for i in range(COUNT) for _ in range(2)][::-1]
    with ThreadPoolExecutor(8) as pool:
        items = list(pool.map(online.__getitem__, order))
    reference = offline_items(offline, range(COUNT))
    for i, item in zip(order, items):
        assert_same_item(item, reference[i], f"sample {i}")


def test_token_id_requests_equal_the_offline_files(service, offline):
    """Samples sent as token ids and loss masks come back as the offline run wrote them."""
    files = [load_sample(offline / f"data_{i}.safetensors") for i in (0, 5)]
    samples = [(f["input_ids"].tolist(), f["loss_mask"].tolist()) for f in files]
    online = OnlineSampleDataset(service["url"], max_len=256, samples=samples, folder=service["dir"])
    reference = offline_items(offline, [0, 5])
    for j in range(2):
        assert_same_item(online[j], reference[j], f"sample {(0, 5)[j]}")


def test_hybrid_second_epoch_reads_the_cache_and_asks_nothing(service, offline, tmp_path):
    """Hybrid: epoch 1 asks for every sample and keeps it; epoch 2 reads the cache only, items unchanged."""
    online = OnlineSampleDataset(
        service["url"], max_len=256, mode="hybrid", cache_dir=tmp_path / "cache", folder=service["dir"]
    )
    first = [online[i] for i in range(COUNT)]
    asked = ProducerClient(service["url"]).info()["requests"]
    second = [online[i] for i in range(COUNT)]
    assert online.requests == COUNT and ProducerClient(service["url"]).info()["requests"] == asked
    reference = offline_items(offline, range(COUNT))
    for i in range(COUNT):
        assert_same_item(first[i], reference[i], f"sample {i}")
        assert_same_item(second[i], reference[i], f"sample {i}, epoch 2")
    assert published(service["dir"]) == []


def test_hybrid_cache_stays_within_its_budget(service, tmp_path):
    """A cache budget of three samples keeps at most three; the rest are read and deleted, and asked again."""
    budget = 3 * 200_000
    online = OnlineSampleDataset(
        service["url"], max_len=256, mode="hybrid", cache_dir=tmp_path / "c", cache_bytes=budget, folder=service["dir"]
    )
    for i in range(COUNT):
        online[i]
    kept = list((tmp_path / "c").glob("data_*.safetensors"))
    assert 0 < len(kept) < COUNT and sum(p.stat().st_size for p in kept) <= budget
    before = online.requests
    for i in range(COUNT):
        online[i]
    assert online.requests - before == COUNT - len(kept)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"index": 99}, f"sample index 99 is not in [0, {COUNT})"),
        ({"input_ids": [1, 2, 10**6], "loss_mask": [0, 1, 1]}, "token ids outside the vocabulary"),
        ({"input_ids": [1] * 300, "loss_mask": None}, "300 input ids exceed this service's --seq-length 256"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "loss_mask must be a list of 3 zeros and ones"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
    ],
)
def test_bad_requests_are_refused_naming_what_is_wrong(service, body, message):
    """A wrong request is a 400 naming what is wrong, raised as ProducerError (no retry); the service goes on."""
    request = urllib.request.Request(service["url"] + "/v1/samples", data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400 and message in json.loads(raised.value.read())["error"]
    client = ProducerClient(service["url"], retries=3, pause=5)
    started = time.monotonic()
    with pytest.raises(ProducerError, match=f"sample x: the producer {service['url']} refused the request: .*"):
        client.request("sample x", index=99) if "index" in body else client.request("sample x", **{
            "input_ids": body["input_ids"], "loss_mask": body.get("loss_mask")})  # fmt: skip
    assert time.monotonic() - started < 5  # not retried
    assert urllib.request.urlopen(service["url"] + "/health", timeout=10).status == 200


def test_bytes_not_taken_stay_under_the_cap_and_publishing_resumes(service):
    """A consumer that does not read: published bytes stop at --max-published-bytes; taking files lets the rest through."""
    client = ProducerClient(service["url"])
    handles = []
    threads = [threading.Thread(target=lambda i=i: handles.append(client.request(f"s{i}", index=i))) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 120
        while ProducerClient(service["url"]).info()["publishing_waiting_seconds"] == 0:
            assert time.monotonic() < deadline, "publishing never reached the cap"
            time.sleep(0.05)
        time.sleep(1)  # a publisher past the cap would show by now
        names = published(service["dir"])
        held = sum((service["dir"] / n).stat().st_size for n in names)
        assert 0 < len(names) < 8 and held <= CAP, (names, held)
        assert ProducerClient(service["url"]).info()["published_not_taken_bytes"] <= CAP
    finally:
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            for name in published(service["dir"]):
                (service["dir"] / name).unlink(missing_ok=True)  # taken
            time.sleep(0.05)
    assert not any(t.is_alive() for t in threads) and len(handles) == 8
    for name in published(service["dir"]):
        (service["dir"] / name).unlink()


def test_a_call_that_timed_out_leaves_nothing_published(service):
    """A call whose tries all time out at the cap: its tries are one request (one id), and the file it got is
    released once published; /v1/info says how long publishing waited at the cap."""
    filler, handles = ProducerClient(service["url"]), {}
    threads = [threading.Thread(target=lambda i=i: handles.setdefault(i, filler.request(f"s{i}", index=i)))
               for i in range(6)]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 120  # the fillers fill the cap first, however slow the machine
        while ProducerClient(service["url"]).info()["publishing_waiting_seconds"] == 0:
            assert time.monotonic() < deadline, "the fillers never reached the cap"
            time.sleep(0.05)
        late = ProducerClient(service["url"], timeout=1.5, retries=2, pause=0.1)
        with pytest.raises(ProducerError, match="sample late: .* did not answer after 3 tries"):
            late.request("sample late", index=7)
        assert ProducerClient(service["url"]).info()["publishing_waiting_seconds"] > 0
    finally:
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            for handle in list(handles.values()):
                (service["dir"] / handle["file"]).unlink(missing_ok=True)  # the fillers' files only: taken
            time.sleep(0.05)
    assert not any(t.is_alive() for t in threads)
    for handle in handles.values():
        (service["dir"] / handle["file"]).unlink(missing_ok=True)
    while published(service["dir"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert published(service["dir"]) == []  # the late call's one file released, not three left unread
    assert ProducerClient(service["url"]).info()["reclaimed"]["released"] >= 1


def test_oversized_bodies_and_fields_are_refused_before_anything_is_kept(service):
    """An 8 MiB consumer field: 413 naming the body limit, the journal unchanged; a long host: 400 naming it."""
    journal = (service["dir"] / JOURNAL).stat().st_size
    big = {"input_ids": [1], "consumer": {"host": "h" * (8 << 20), "pid": 1, "start": 1}}
    request = urllib.request.Request(service["url"] + "/v1/samples", data=json.dumps(big).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 413 and "at most 73,728 bytes" in json.loads(raised.value.read())["error"]
    long_host = {"input_ids": [1], "consumer": {"host": "h" * 1000, "pid": 1, "start": 1}}
    request = urllib.request.Request(service["url"] + "/v1/samples", data=json.dumps(long_host).encode())
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400 and "consumer.host: at most 255" in json.loads(raised.value.read())["error"]
    assert (service["dir"] / JOURNAL).stat().st_size == journal


def consumer_that_waits(url: str, field: str) -> tuple[subprocess.Popen, list[str]]:
    """A consumer process that asks for samples 0 and 1, prints their handles' ``field`` and never reads them."""
    script = (
        "import sys; from speculators_v016.online import ProducerClient\n"
        "c = ProducerClient(sys.argv[1], timeout=120, retries=0)\n"
        f"for i in range(2): print(c.request('s', index=i)[{field!r}], flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True)
    handles = [proc.stdout.readline().strip() for _ in range(2)]
    if not all(handles):
        proc.kill()
        pytest.fail(f"the consumer got no handles: {handles}")
    return proc, handles


def test_what_a_dead_consumer_left_is_reclaimed(service):
    """A consumer killed before reading: the service deletes its published files, by record, within seconds."""
    proc, files = consumer_that_waits(service["url"], "file")
    assert all((service["dir"] / f).exists() for f in files)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # looked for every second; the margin is for a loaded machine
    while any((service["dir"] / f).exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any((service["dir"] / f).exists() for f in files)
    assert ProducerClient(service["url"]).info()["reclaimed"]["consumer_dead"] >= 2


def test_a_folder_in_use_or_holding_foreign_files_is_refused(service, model_dir, tmp_path):
    """A second service on a live service's folder, or a folder with files no record names: exit 4, named."""
    proc, url, lines = start_service(model_dir, service["dir"])
    assert url is None and proc.returncode == 4
    assert f"--serve-dir {service['dir']} is in use by a running service (pid {service['proc'].pid})" in "".join(lines)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    proc, url, lines = start_service(model_dir, foreign)
    assert url is None and proc.returncode == 4 and "holds files no record of ours names (notes.txt)" in "".join(lines)
    assert (foreign / "notes.txt").read_text() == "mine"
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    (unrecorded / ".tmp-online_3.safetensors.1").write_text("not in any record")  # our naming, no record
    proc, url, lines = start_service(model_dir, unrecorded)
    assert url is None and proc.returncode == 4 and ".tmp-online_3.safetensors.1" in "".join(lines)
    assert (unrecorded / ".tmp-online_3.safetensors.1").exists()


def test_a_deleted_lock_is_made_again_and_a_second_service_still_refused(service, model_dir):
    """The lock file deleted while the service runs: the service makes it again within seconds, and a second
    service on the folder is refused (exit 4), deleting nothing."""
    lock = service["dir"] / LOCK
    lock.unlink()
    deadline = time.monotonic() + 10
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lock.read_text() == str(service["proc"].pid)
    kept = ProducerClient(service["url"]).request("kept", index=0)["file"]
    proc, url, lines = start_service(model_dir, service["dir"])
    assert url is None and proc.returncode == 4 and "is in use by a running service" in "".join(lines)
    assert (service["dir"] / kept).exists()
    (service["dir"] / kept).unlink()


def train_steps(model_dir, offline, save_dir, producer=None, rank=None, world=None, folder=None) -> subprocess.Popen:
    """Upstream's trainer, seeded, on the offline files or through a producer (tests/helpers/eagle3_train_steps.py);
    ``folder``: the serve folder, given to its datasets by the service's variable."""
    script = Path(__file__).parents[1] / "helpers" / "eagle3_train_steps.py"
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", **({"RANK": str(rank), "WORLD_SIZE": str(world)} if world else {})}
    if folder is not None:
        env[SERVE_DIR_VARIABLE] = str(folder)
    args = [
        sys.executable,
        script,
        model_dir,
        offline,
        offline.parent / "tf.pt",
        save_dir,
        *([producer] if producer else []),
    ]
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def losses_of(proc: subprocess.Popen) -> list[float]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["changed"] and result["finite"]
    return result["losses"]


def test_trainer_losses_online_equal_offline(service, offline, model_dir, tmp_path):
    """Upstream's trainer, seeded, four steps: the same losses online (two forked loader workers) as offline."""
    offline_losses = losses_of(train_steps(model_dir, offline, tmp_path / "a"))
    assert len(offline_losses) == 4
    assert (
        losses_of(train_steps(model_dir, offline, tmp_path / "b", service["url"], folder=service["dir"]))
        == offline_losses
    )


@pytest.fixture(scope="module")
def offline_rank_losses(offline, model_dir, tmp_path_factory):
    """Each of two ranks' losses, trained on the offline files (the reference of the two-rank tests)."""
    save = tmp_path_factory.mktemp("offline-ranks")
    ranks = [train_steps(model_dir, offline, save / f"r{r}", None, r, 2) for r in range(2)]
    losses = [losses_of(p) for p in ranks]
    assert all(losses)
    return losses


def test_two_ranks_train_online_as_offline(service, offline, model_dir, tmp_path, offline_rank_losses):
    """Two trainer ranks at once, each its batches from upstream's multipack sampler over all samples, online:
    each rank's losses equal its offline ones."""
    ranks = [
        train_steps(model_dir, offline, tmp_path / f"on{r}", service["url"], r, 2, service["dir"]) for r in range(2)
    ]
    assert [losses_of(p) for p in ranks] == offline_rank_losses


@pytest.fixture(scope="module")
def peer_python():
    """Upstream's released 0.9.0 data path in a venv of its own (helpers/peer_venv.py: tools/test.sh starts its
    build in the background; here it is waited for, or made, and kept in build/ between local runs)."""
    return peer_venv.ensure()


def test_upstream_090_client_gets_the_offline_states(service, offline, peer_python, model_dir, tmp_path):
    """Upstream 0.9.0's generate_hidden_states, FileTransfer and ArrowDataset against the service: its
    check passes, the files equal the offline run's states bit for bit, and it deletes what it read."""
    files = [load_sample(offline / f"data_{i}.safetensors") for i in (2, 7)]
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps([{k: f[k].tolist() for k in ("input_ids", "loss_mask")} for f in files]))
    script = Path(__file__).parents[1] / "helpers" / "peer_client_090.py"
    proc = subprocess.run([peer_python, script, service["url"], model_dir, requests, tmp_path],
                          capture_output=True, text=True, timeout=600, env=peer_venv.ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"approx_lengths": [len(f["input_ids"]) for f in files],
                                                                "len": 2}  # fmt: skip
    for i, f in enumerate(files):
        got = load_file(tmp_path / f"generated_{i}.safetensors")
        assert torch.equal(got["token_ids"], f["input_ids"])
        assert got["hidden_states"].shape == (len(f["input_ids"]), 4, 128)
        for j, layer in enumerate(f["hidden_states"]):
            assert torch.equal(got["hidden_states"][:, j], layer), (i, j)
    item, first = load_file(tmp_path / "item_0.safetensors"), files[0]
    assert torch.equal(item["hidden_states"], torch.cat(first["hidden_states"][:3], dim=-1))
    assert torch.equal(item["verifier_last_hidden_states"], first["hidden_states"][3])
    assert torch.equal(item["input_ids"], first["input_ids"]) and torch.equal(item["loss_mask"], first["loss_mask"])
    assert published(service["dir"]) == []  # upstream's reader deleted every file it read


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "some text"}, "prompt must be token ids"),
        ({"prompt": [1, 2, 3], "max_tokens": 16}, "max_tokens 16: this service captures prefill only"),
        (
            {"prompt": [1, 2], "kv_transfer_params": {"hidden_states_path": "/tmp/x"}},
            "client-chosen hidden_states_path",
        ),
        ({"prompt": [1, 2], "model": "other"}, "model 'other' is not served here"),
    ],
)
def test_what_the_peer_protocol_does_not_serve_is_refused_by_name(service, model_dir, body, message):
    """/v1/completions requests this service cannot honour are a 400 that says which part and why."""
    body = {"model": model_dir, **body}
    request = urllib.request.Request(service["url"] + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400 and message in json.loads(raised.value.read())["error"]


@pytest.fixture(scope="module")
def mooncake_service(model_dir, data_file):
    """The same service with the Mooncake store as its backend (master started by the service, TCP), and an API
    key: its variable, which the service reads as --api-key and every client of these tests (and their
    subprocesses) sends."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_VARIABLE, API_KEY)
        proc, url, lines = start_service(model_dir, None, data_file=data_file)
        assert url, "".join(lines)
        yield {"url": url, "proc": proc, "start": "".join(lines)}
        stop_service(proc)


@functools.cache
def _store_client(master: str):
    return MooncakeReader(master, 1 << 20)._client()


def mooncake_keys(url: str, keys: list[str]) -> list[int]:
    """batch_is_exist of ``keys`` in the service's store, asked by a store client of this process."""
    return _store_client(ProducerClient(url).info()["backend"]["master"]).batch_is_exist(keys)


def test_mooncake_items_equal_the_offline_files_bit_for_bit(mooncake_service, offline):
    """Through the Mooncake store over TCP: every item equals upstream's item of the offline file; each object
    is removed once read."""
    assert "publishing to the Mooncake store (master 127.0.0.1:" in mooncake_service["start"]
    online = OnlineSampleDataset(mooncake_service["url"], max_len=256)
    reference = offline_items(offline, range(COUNT))
    with ThreadPoolExecutor(4) as pool:
        items = list(pool.map(online.__getitem__, range(COUNT)))
    for i in range(COUNT):
        assert_same_item(items[i], reference[i], f"sample {i}")
    info = ProducerClient(mooncake_service["url"]).info()
    assert info["backend"]["kind"] == "mooncake" and info["published_not_taken_bytes"] == 0


def test_a_service_with_an_api_key_refuses_requests_without_it(mooncake_service):
    """--api-key (from its variable): /v1/info and /v1/samples without the bearer key are 401, a wrong key is a
    ProducerError naming it, not retried; /health needs none."""
    url = mooncake_service["url"]
    for request in (urllib.request.Request(url + "/v1/info"),
                    urllib.request.Request(url + "/v1/samples", data=b'{"index": 0}', method="POST")):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=60)
        assert raised.value.code == 401 and "Authorization: Bearer" in json.loads(raised.value.read())["error"]
    with pytest.raises(ProducerError, match="refused the request: this service needs its API key"):
        ProducerClient(url, api_key="wrong", retries=3, pause=5).request("s", index=0)
    assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
    assert ProducerClient(url).info()["requests"] >= COUNT  # the key from the variable


def test_mooncake_two_ranks_train_as_offline(mooncake_service, offline, model_dir, tmp_path, offline_rank_losses):
    """Two trainer ranks through the Mooncake store (two forked workers each): each rank's offline losses."""
    ranks = [train_steps(model_dir, offline, tmp_path / f"on{r}", mooncake_service["url"], r, 2) for r in range(2)]
    assert [losses_of(p) for p in ranks] == offline_rank_losses


def test_mooncake_objects_of_a_dead_consumer_are_removed(mooncake_service):
    """A consumer killed before reading: its objects leave the store, by record, within seconds."""
    proc, keys = consumer_that_waits(mooncake_service["url"], "key")
    assert mooncake_keys(mooncake_service["url"], keys) == [1, 1]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # looked for every second; the margin is for a loaded machine
    while mooncake_keys(mooncake_service["url"], keys) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mooncake_keys(mooncake_service["url"], keys) == [0, 0]
    assert ProducerClient(mooncake_service["url"]).info()["reclaimed"]["consumer_dead"] >= 2


def test_killed_producer_fails_clients_by_name_and_a_new_one_reclaims_its_files(service, model_dir):
    """SIGKILL the service: a dataset item fails within seconds naming sample and producer; a restart on the
    folder reclaims what the dead one published and no one took."""
    left = ProducerClient(service["url"]).request("left", index=1)["file"]  # published, never taken
    online = OnlineSampleDataset(service["url"], max_len=256, retries=1, folder=service["dir"])
    online.client.pause = 0.2
    service["proc"].kill()
    service["proc"].wait()
    started = time.monotonic()
    with pytest.raises(ProducerError, match=rf"sample 3: the producer {service['url']} did not answer after 2 tries"):
        online[3]
    assert time.monotonic() - started < 5
    assert (service["dir"] / left).exists() and (service["dir"] / JOURNAL).exists()
    proc, url, lines = start_service(model_dir, service["dir"])
    try:
        assert url, "".join(lines)
        assert "(reclaimed 1 files a stopped service published)" in "".join(lines)
        assert not (service["dir"] / left).exists()
    finally:
        code, rest = stop_service(proc)
    assert code == 0, rest
