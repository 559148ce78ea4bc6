"""The real `serve` facing strangers on loopback: heads bounded in bytes and time, idle and keyless connections
making room for keyed clients, /health reporting saturation; the folder's lock under deletion; the consumer's
folder its own. Every client here targets 127.0.0.1, in bounded loops.

One service (the real command, CPU vLLM, eager, fp32) serves the module, with an API key (its variable, which
the clients here read too), 16 connections, a 2 s header timeout (the read timeout is the default 30 s) and a
publishing cap of one byte: one published file not taken holds every later request, served and waiting.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.cli import CPU
from speculators_v016.online import OnlineSampleDataset, ProducerClient, ProducerError
from speculators_v016.online.client import API_KEY_VARIABLE
from speculators_v016.serve.folder import LOCK, ServeDir, ServeDirError

KEY = "test-key-of-the-front-service"
PLACES = 16
HEADER_TIMEOUT = 2.0
ROWS = [(list(range(30 + i, 70 + i)), [1] * 40) for i in range(8)]


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_dir):
    serve_dir = tmp_path_factory.mktemp("serve-front") / "states"
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "serve", "--target-model-path", model_dir,
           "--serve-dir", serve_dir, "--port", 0, "--seq-length", 256, "--enforce-eager", "--dtype", "float32", "--max-num-seqs", 1,
           "--max-published-bytes", 1, "--max-connections", PLACES, "--header-timeout", HEADER_TIMEOUT]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_VARIABLE, KEY)  # the service's --api-key, and every client's here
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **CPU})  # fmt: skip
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving "):
                break
        url = re.search(r" at (http://[\d.]+:\d+): ", lines[-1])
        assert url, "".join(lines)
        host, port = url.group(1).removeprefix("http://").split(":")
        yield {"url": url.group(1), "address": (host, int(port)), "dir": serve_dir, "proc": proc}
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def connect(service) -> socket.socket:
    return socket.create_connection(service["address"], timeout=10)


def closed_by_the_service(sock: socket.socket, wait: float) -> bytes | None:
    """What the service answered before closing ``sock`` (b"" for nothing) within ``wait`` s; None: still open."""
    sock.settimeout(wait)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return answer


def rss(pid: int) -> int:
    """The process's resident memory, bytes."""
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10


def consumer(service, rows=ROWS) -> OnlineSampleDataset:
    return OnlineSampleDataset(service["url"], max_len=256, samples=rows, retries=0, folder=service["dir"])


def test_a_head_over_32_kib_is_refused_naming_the_bound(service):
    """A request whose line and headers take 40 KiB in all (lines the standard library takes): a 431 naming the
    bound, before any key is looked at."""
    head = b"GET /v1/info HTTP/1.1\r\n" + b"".join(b"X-Fill-%d: %s\r\n" % (i, b"a" * 4000) for i in range(10))
    with connect(service) as sock:
        sock.sendall(head + b"\r\n")
        answer = closed_by_the_service(sock, 10)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"at most 32,768 bytes in all" in answer, answer


def test_a_flood_of_large_headers_is_cut_at_once_and_holds_no_memory(service):
    """16 connections each sending 99 header lines of 64 KB before any key: each is cut at once, and the service's
    memory stays flat."""
    before = rss(service["proc"].pid)
    flood = [connect(service) for _ in range(PLACES)]
    for sock in flood:
        sock.settimeout(5)
    line = b"X-Fill: " + b"a" * 64000 + b"\r\n"
    open_ = list(flood)
    for sock in open_:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\n")
    for _ in range(99):  # bounded: 99 lines to each connection still open
        for sock in list(open_):
            try:
                sock.sendall(line)
            except OSError:
                open_.remove(sock)
        if not open_:
            break
    grown = rss(service["proc"].pid) - before
    try:
        assert grown < 16 << 20, f"the service grew by {grown / 2**20:.0f} MiB"
        assert all(closed_by_the_service(sock, 5) is not None for sock in flood)
    finally:
        for sock in flood:
            sock.close()


def test_idle_connections_without_the_key_make_room_for_a_keyed_request(service):
    """Every place held by idle connections that never sent a request: a keyed request is served at once (no retry),
    taking the place of the longest idle one, which is cut."""
    idle = [connect(service) for _ in range(PLACES)]
    try:
        time.sleep(0.2)  # all accepted
        ds = consumer(service)
        started = time.monotonic()
        assert ds[0]["input_ids"].tolist() == ROWS[0][0][1:]  # upstream shifts by one
        assert time.monotonic() - started < 10
        assert closed_by_the_service(idle[0], 5) == b""
    finally:
        for sock in idle:
            sock.close()


def test_connections_reopened_as_they_are_cut_keep_no_keyed_client_out(service):
    """More idle connections than places, each reopened as soon as it is seen cut: six keyed calls in a row, each
    with no retry, are all served."""
    stop = threading.Event()
    reopened = []

    def churn():
        held = [connect(service) for _ in range(PLACES + 4)]
        for sock in held:
            sock.setblocking(False)
        deadline = time.monotonic() + 120  # bounded whatever the test does
        while not stop.is_set() and time.monotonic() < deadline:
            for i, sock in enumerate(held):
                try:
                    gone = sock.recv(1) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    sock.close()
                    held[i] = connect(service)
                    held[i].setblocking(False)
                    reopened.append(i)
            time.sleep(0.1)
        for sock in held:
            sock.close()

    flooder = threading.Thread(target=churn)
    flooder.start()
    try:
        time.sleep(0.5)
        ds = consumer(service)
        for i in range(6):
            assert ds[i]["input_ids"].tolist() == ROWS[i][0][1:]
    finally:
        stop.set()
        flooder.join(timeout=30)
    assert reopened  # the flood was cut and came back


def test_a_head_must_arrive_within_the_header_timeout(service):
    """--header-timeout 2 (the read timeout is 30 s): a connection that sends nothing, and one sending its headers
    a byte every 0.2 s, are cut after about 2 s; a keyed request meanwhile is served."""
    idle, dribbling = connect(service), connect(service)
    started = time.monotonic()
    try:
        dribbling.setblocking(False)
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 50:  # bounded: 10 s at most
            try:
                dribbling.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
        cut_after = time.monotonic() - started
        assert closed_by_the_service(idle, 5) == b""
        assert HEADER_TIMEOUT - 0.5 < cut_after < HEADER_TIMEOUT + 3, cut_after
        assert consumer(service)[1]["input_ids"].tolist() == ROWS[1][0][1:]
    finally:
        idle.close()
        dribbling.close()


def test_a_deleted_lock_lets_no_second_service_take_the_folder(service):
    """The lock file deleted under the live service and the folder taken at once, before the service makes the
    file again: refused naming the folder in use; the service's unread file is still there, and it goes on."""
    client = ProducerClient(service["url"], retries=0)
    unread = client.request("unread", input_ids=ROWS[2][0], loss_mask=ROWS[2][1])["file"]
    (service["dir"] / LOCK).unlink()
    with pytest.raises(ServeDirError, match=rf"--serve-dir {service['dir']} is in use by a running service"):
        ServeDir(service["dir"], 1 << 20, 60).open()
    assert (service["dir"] / unread).exists()
    deadline = time.monotonic() + 10
    while not (service["dir"] / LOCK).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (service["dir"] / LOCK).read_text() == str(service["proc"].pid)
    (service["dir"] / unread).unlink()  # taken
    assert consumer(service)[2]["input_ids"].tolist() == ROWS[2][0][1:]


def test_the_consumers_folder_is_its_own_and_checked_against_the_service(service, tmp_path):
    """A consumer given a folder that is not the service's is refused naming both; the service's folder seen
    through a link is the same folder (its journal names this service)."""
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ProducerError) as caught:
        OnlineSampleDataset(service["url"], max_len=256, samples=ROWS, folder=other)
    assert re.fullmatch(
        rf"the producer {service['url']} publishes to the folder '{service['dir']}', not to {other}: {other} holds "
        r"no service's journal, the producer's is [0-9a-f]{32}",
        str(caught.value),
    ), caught.value
    link = tmp_path / "link"
    link.symlink_to(service["dir"])
    ds = OnlineSampleDataset(service["url"], max_len=256, samples=ROWS, retries=0, folder=link)
    assert ds[3]["input_ids"].tolist() == ROWS[3][0][1:] and not any(service["dir"].glob("online_*"))


def test_when_every_connection_is_served_health_says_so(service):
    """Every place served (requests held by a file not taken): a newcomer is answered 503 at once naming
    --max-connections, and /health stays 503 naming the refusal for a while after the places are free."""
    client = ProducerClient(service["url"], timeout=120, retries=0)
    held = client.request("held", input_ids=ROWS[4][0], loss_mask=ROWS[4][1])["file"]  # not taken: the cap is full
    files, errors = [], []

    def ask(i):
        try:
            files.append(client.request(f"s{i}", input_ids=ROWS[i % 8][0], loss_mask=ROWS[i % 8][1])["file"])
        except ProducerError as exc:
            errors.append(str(exc))

    with ThreadPoolExecutor(PLACES) as pool:
        asked = [pool.submit(ask, i) for i in range(PLACES)]
        try:
            time.sleep(2)  # every request read whole (served), before /health's connections come
            deadline, answer = time.monotonic() + 60, b""
            while b"being served" not in answer and time.monotonic() < deadline:  # until every place is served
                with connect(service) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\n\r\n")
                    answer = closed_by_the_service(sock, 5) or b""
                time.sleep(0.1)
            assert answer.startswith(b"HTTP/1.1 503 ") and (
                b"every one of this service's --max-connections 16 connections is being served" in answer
            ), answer
        finally:
            (service["dir"] / held).unlink()  # taken: the held requests are published one by one
            deadline = time.monotonic() + 120
            while not all(f.done() for f in asked) and time.monotonic() < deadline:
                for name in list(files):
                    (service["dir"] / name).unlink(missing_ok=True)
                time.sleep(0.05)
    for name in files:
        (service["dir"] / name).unlink(missing_ok=True)
    assert errors == [] and len(files) == PLACES
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(service["url"] + "/health", timeout=10)
    body = json.loads(raised.value.read())
    assert raised.value.code == 503 and re.match(
        rf"a connection was refused \d+ s ago: every one of --max-connections {PLACES} was being served", body["error"]
    ), body
    assert body["connections"]["refused"] >= 1
