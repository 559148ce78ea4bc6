"""The service's HTTP front (speculators_v016.serve.http_api) against a stand-in service, no engine: slow
clients cut, heads bounded in bytes and time, idle and keyless connections cut for newcomers, threads
bounded, saturation reported, bodies and fields bounded, malformed headers answered, the API key
required, retries of one request answered once, and the client's key kept from proxies and redirects.
Every client here targets 127.0.0.1, in bounded loops."""

import http.client
import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest

from speculators_v016.online.client import API_KEY_VARIABLE, ProducerClient, ProducerError
from speculators_v016.serve.auth import exposure_warning
from speculators_v016.serve.http_api import HttpFront, max_body_bytes
from speculators_v016.serve.service import RequestError

KEY = "s3cret-key"


class StandIn:
    """What the front asks of a CaptureService: answers at once, counts what it was asked."""

    served_model_name = "tiny"

    def __init__(self):
        self.failure, self.stopping, self.submitted, self.released = None, False, [], []
        self.backend = SimpleNamespace(kind="folder", path_of=lambda handle: f"/states/{handle['file']}")
        self.blocked = None

    def info(self) -> dict:
        return {"service": "stand-in"}

    def health(self) -> str | None:
        return self.blocked

    def down(self):
        return RuntimeError("down")

    def sample_of(self, index):
        raise RequestError("no dataset")

    def submit(self, ids, mask, consumer=None, layout="sample", request_id=None) -> Future:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        self.submitted.append((ids, consumer, request_id))
        future = Future()
        future.set_result({"backend": "folder", "file": f"online_{len(self.submitted) - 1}.safetensors"})
        return future

    def release(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


def start(stand_in=None, **limits) -> tuple[HttpFront, StandIn]:
    stand_in = stand_in or StandIn()
    return HttpFront(stand_in, "127.0.0.1", 0, **limits).start(), stand_in


@pytest.fixture
def front():
    front, stand_in = start()
    yield front, stand_in
    front.stop()


def raw(front: HttpFront, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` on a fresh connection; the one answer read back (head and its Content-Length of body)."""
    with socket.create_connection((front.host, front.port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
            head, _, body = out.partition(b"\r\n\r\n")
            length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
            if length and len(body) >= int(length[0].split(b":")[1]):
                break
        return out


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_content_length_that_is_not_a_number_is_a_400_naming_the_header(front, capfd):
    """`Content-Length: abc`: a 400 naming the header, no traceback; the front goes on serving."""
    front, _ = front
    answer = raw(front, b"POST /v1/samples HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    code, error = status_and_error(answer)
    assert code == 400 and "Content-Length header 'abc'" in error
    assert "Traceback" not in capfd.readouterr().err
    assert urllib.request.urlopen(front.url + "/health", timeout=10).status == 200


def test_a_body_over_the_limit_is_a_413_naming_it_and_never_read(front):
    """A declared body over the limit (sized from --seq-length) is refused with 413 before a byte of it is read."""
    front, stand_in = front
    limit = max_body_bytes(2048)
    answer = raw(front, f"POST /v1/samples HTTP/1.1\r\nContent-Length: {16 << 20}\r\n\r\n[{{}},".encode())
    code, error = status_and_error(answer)
    assert code == 413 and f"at most {limit:,} bytes" in error and str(16 << 20) in error.replace(",", "")
    assert stand_in.submitted == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1], "consumer": {"host": "h" * 300, "pid": 1, "start": 2}}, "consumer.host: at most 255"),
        ({"input_ids": [1], "consumer": {"host": "h", "pid": 1, "start": 2, "x": "y" * 100}}, "consumer: keys"),
        ({"input_ids": [1], "consumer": "me"}, "consumer: an object"),
        ({"input_ids": [1], "request_id": "r" * 65}, "request_id: at most 64"),
        ({"input_ids": [1], "notes": "x" * 1000}, "unknown field 'notes'"),
    ],
)
def test_fields_are_bounded_and_refused_by_name(front, body, message):
    """A consumer field, a request id or a field the front does not know: a 400 naming it and its limit."""
    front, stand_in = front
    code, answer = post(front.url + "/v1/samples", body)
    assert code == 400 and message in answer["error"], answer
    assert stand_in.submitted == []


def test_slow_clients_are_cut_and_an_honest_one_is_served_meanwhile():
    """Clients sending headers a byte at a time or a short body hold a thread no longer than the read timeout;
    an honest client is answered while they dribble."""
    front, stand_in = start(read_timeout=1.0, max_connections=16)
    try:
        slow = [socket.create_connection((front.host, front.port), timeout=10) for _ in range(8)]
        for i, sock in enumerate(slow):
            sock.sendall(b"POST /v1/samples HTTP/1.1\r\nContent-Length: 100\r\n\r\n{" if i % 2 else b"P")
        started = time.monotonic()
        code, answer = post(front.url + "/v1/samples", {"input_ids": [1, 2]})
        assert code == 200 and answer["handle"]["file"] == "online_0.safetensors"
        cut = []
        for _ in range(40):  # a byte every 0.1 s to each: bounded, about 4 s at most
            for sock in slow:
                if sock not in cut:
                    try:
                        sock.sendall(b"x")
                    except OSError:
                        cut.append(sock)
            if len(cut) == len(slow):
                break
            time.sleep(0.1)
        for sock in slow:
            sock.close()
        assert len(cut) == len(slow) and time.monotonic() - started < 4.5
    finally:
        front.stop()


def cut(sock: socket.socket, wait: float) -> bool:
    """Did the front close ``sock`` (within ``wait`` seconds), without an answer?"""
    sock.settimeout(wait)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_beyond_the_cap_are_cut_oldest_first_and_threads_stay_bounded():
    """More idle connections than --max-connections: each newcomer takes the place of the oldest idle one (cut,
    unanswered); the newest are held, and there is never more than a thread a place."""
    front, _ = start(read_timeout=30.0, max_connections=8)
    threads_before = threading.active_count()
    held = []
    try:
        for _ in range(40):
            held.append(socket.create_connection((front.host, front.port), timeout=10))
        assert all(cut(sock, 5) for sock in held[:32])
        assert not any(cut(sock, 0.2) for sock in held[32:])
        assert threading.active_count() <= threads_before + 8
        assert (front.server.cut, front.server.refused) == (32, 0)
    finally:
        for sock in held:
            sock.close()
        front.stop()


def test_a_keyed_idle_connection_outlives_connections_without_the_key():
    """With --api-key, connections that never carried the key go first: a client's keep-alive connection, the
    oldest of all, is still served after 12 newcomers passed a cap of 4."""
    front, _ = start(api_key=KEY, max_connections=4)
    client = http.client.HTTPConnection(front.host, front.port, timeout=10)
    try:
        client.request("GET", "/v1/info", headers={"Authorization": f"Bearer {KEY}"})
        assert client.getresponse().read() == b'{"service": "stand-in"}'
        strangers = [socket.create_connection((front.host, front.port), timeout=10) for _ in range(12)]
        assert sum(cut(sock, 5) for sock in strangers[:9]) == 9
        client.request("GET", "/v1/info", headers={"Authorization": f"Bearer {KEY}"})  # the same connection
        assert client.getresponse().read() == b'{"service": "stand-in"}'
        for sock in strangers:
            sock.close()
    finally:
        client.close()
        front.stop()


def test_a_keyed_request_whose_body_is_on_its_way_is_never_cut():
    """With --api-key, a request whose key was checked is served from then on: newcomers beyond the cap cut each
    other, never it, and its body, sent after them, is answered."""
    front, stand_in = start(api_key=KEY, max_connections=2)
    body = b'{"input_ids": [7]}'
    keyed = socket.create_connection((front.host, front.port), timeout=10)
    try:
        keyed.sendall(b"POST /v1/samples HTTP/1.1\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
                      % (KEY.encode(), len(body)))  # fmt: skip
        deadline = time.monotonic() + 10
        while front.server.saturation()[0]["served"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        strangers = [socket.create_connection((front.host, front.port), timeout=10) for _ in range(5)]
        assert sum(cut(sock, 5) for sock in strangers[:4]) == 4
        keyed.sendall(body)
        assert keyed.recv(4096).startswith(b"HTTP/1.1 200") and stand_in.submitted == [([7], None, None)]
        for sock in strangers:
            sock.close()
    finally:
        keyed.close()
        front.stop()


def test_when_every_connection_is_served_a_newcomer_gets_503_and_health_says_so_after():
    """Every place served (requests waiting on the service): a newcomer is answered 503 at once naming
    --max-connections, and /health is 503 naming the refusal for a while after, with the counters."""
    stand_in, release = StandIn(), threading.Event()
    answer = stand_in.submit

    def waiting_submit(*args, **kwargs):
        release.wait(30)
        return answer(*args, **kwargs)

    stand_in.submit = waiting_submit
    front, _ = start(stand_in, max_connections=4)
    try:
        with ThreadPoolExecutor(4) as pool:
            served = [pool.submit(post, front.url + "/v1/samples", {"input_ids": [1]}) for _ in range(4)]
            deadline = time.monotonic() + 10
            while front.server.saturation()[0]["served"] < 4:
                assert time.monotonic() < deadline, front.server.saturation()
                time.sleep(0.02)
            code, error = status_and_error(raw(front, b"GET /health HTTP/1.1\r\n\r\n"))
            assert (
                code == 503 and "every one of this service's --max-connections 4 connections is being served" in error
            )
            release.set()
            assert [f.result()[0] for f in served] == [200] * 4
        deadline = time.monotonic() + 10  # the clients closed; the front notices each close on its own thread
        while front.server.saturation()[0]["open"] > 0:
            assert time.monotonic() < deadline, front.server.saturation()
            time.sleep(0.02)
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(front.url + "/health", timeout=10)
        body = json.loads(raised.value.read())
        assert (
            raised.value.code == 503
            and "a connection was refused 0 s ago: every one of --max-connections 4 was being served (1 refused so far)"
            in body["error"]
        )
        assert body["connections"] == {"open": 1, "served": 1, "max": 4, "cut": 0, "refused": 1}
    finally:
        release.set()
        front.stop()


def test_a_head_over_its_byte_bound_is_a_431_and_nothing_more_is_kept(front):
    """Request line and headers over 32 KiB in all (each line well under the standard library's 64 KiB): a 431
    naming the bound, the connection closed; the front goes on."""
    front, stand_in = front
    head = b"POST /v1/samples HTTP/1.1\r\n" + b"".join(b"X-Fill-%d: %s\r\n" % (i, b"a" * 4000) for i in range(9))
    code, error = status_and_error(raw(front, head))
    assert code == 431 and "a request's line and headers take at most 32,768 bytes in all" in error
    code, error = status_and_error(raw(front, b"GET /" + b"a" * 40000 + b" HTTP/1.1\r\n\r\n"))
    assert code == 431 and "32,768 bytes" in error
    assert stand_in.submitted == []
    assert urllib.request.urlopen(front.url + "/health", timeout=10).status == 200


def test_a_head_must_arrive_within_the_header_timeout_and_a_body_within_the_read_timeout():
    """--header-timeout: a connection sending nothing, or its headers a byte at a time, is cut after it, though
    --read-timeout is longer; a request whose head came in time has --read-timeout for its body."""
    front, stand_in = start(read_timeout=4.0, header_timeout=1.0)
    try:
        idle = socket.create_connection((front.host, front.port), timeout=10)
        dribbling = socket.create_connection((front.host, front.port), timeout=10)
        body = b'{"input_ids": [1, 2]}'
        slow_body = socket.create_connection((front.host, front.port), timeout=10)
        slow_body.sendall(b"POST /v1/samples HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        started = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100:  # a byte every 0.1 s: bounded, 10 s at most
            try:
                dribbling.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - started > 1.0 and cut(idle, 0.1):
                break
            time.sleep(0.1)
        assert cut(dribbling, 2) and cut(idle, 0.5) and time.monotonic() - started < 3.0
        slow_body.sendall(body)  # 1.5 s and more after its head: within --read-timeout, served
        answer = slow_body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200") and stand_in.submitted == [([1, 2], None, None)]
        for sock in (idle, dribbling, slow_body):
            sock.close()
    finally:
        front.stop()


def test_stop_returns_at_once_not_at_the_serving_loops_next_half_second():
    """stop() waits for the serving loop's next look (STOP_POLL, 0.05 s), not the standard library's 0.5 s: five
    fronts started, asked and stopped take well under the 2.5 s those looks took."""
    started = time.monotonic()
    for _ in range(5):
        front, _ = start()
        assert urllib.request.urlopen(front.url + "/health", timeout=10).status == 200
        front.stop()
    assert time.monotonic() - started < 1.5


def test_eighty_simultaneous_clients_are_all_answered(front):
    """A burst of 80 clients at once: every one is answered (the listen backlog holds them)."""
    front, _ = front
    assert front.server.request_queue_size >= 128

    def health(_):
        with urllib.request.urlopen(front.url + "/health", timeout=30) as response:
            return response.status

    with ThreadPoolExecutor(80) as pool:
        assert list(pool.map(health, range(80))) == [200] * 80


def test_health_says_when_publishing_is_blocked(front):
    """/health is 503 naming why while the service says publishing is blocked at the cap."""
    front, stand_in = front
    stand_in.blocked = "publishing has waited 31 s at --max-published-bytes"
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(front.url + "/health", timeout=10)
    assert raised.value.code == 503 and "--max-published-bytes" in json.loads(raised.value.read())["error"]


@pytest.fixture
def keyed():
    front, stand_in = start(api_key=KEY)
    yield front, stand_in
    front.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_with_an_api_key_every_endpoint_but_health_needs_it(keyed, headers):
    """--api-key: /v1/info, /v1/models, /v1/samples, /v1/completions are 401 without the bearer key; /health is not."""
    front, stand_in = keyed
    for path in ("/v1/info", "/v1/models"):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(urllib.request.Request(front.url + path, headers=headers), timeout=10)
        assert raised.value.code == 401 and "Authorization: Bearer" in json.loads(raised.value.read())["error"]
    for path in ("/v1/samples", "/v1/completions", "/v1/release"):
        code, answer = post(front.url + path, {"input_ids": [1]}, headers)
        assert code == 401 and "API key" in answer["error"]
    assert stand_in.submitted == [] and stand_in.released == []
    assert urllib.request.urlopen(front.url + "/health", timeout=10).status == 200


def test_the_client_sends_the_key_given_or_from_its_variable(keyed, monkeypatch):
    """ProducerClient with api_key, or with SPECULATORS_DATA_GEN_SERVE_API_KEY set, is served; without: a
    ProducerError naming the 401, not retried."""
    front, stand_in = keyed
    assert ProducerClient(front.url, api_key=KEY).info() == {"service": "stand-in"}
    monkeypatch.setenv(API_KEY_VARIABLE, KEY)
    assert ProducerClient(front.url).request("s", input_ids=[1, 2])["file"] == "online_0.safetensors"
    monkeypatch.delenv(API_KEY_VARIABLE)
    started = time.monotonic()
    with pytest.raises(ProducerError, match="refused the request: .*API key"):
        ProducerClient(front.url, retries=3, pause=5).info()
    assert time.monotonic() - started < 5


def test_an_openai_client_with_the_key_is_served(keyed):
    """The OpenAI client (what upstream 0.9.0's generate_hidden_states is given) sends api_key as the bearer key."""
    front, stand_in = keyed
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key=KEY, max_retries=0)
    answer = client.completions.create(model="tiny", prompt=[[1, 2, 3]], max_tokens=1)
    assert answer.model_extra["kv_transfer_params"] == {"hidden_states_path": "/states/online_0.safetensors"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{front.url}/v1", api_key="EMPTY", max_retries=0).models.list()


def test_binding_beyond_loopback_without_a_key_is_warned():
    """A warning for 0.0.0.0 or a routable address without --api-key; none for loopback or with a key."""
    assert "--api-key" in exposure_warning("0.0.0.0", None)
    assert "--api-key" in exposure_warning("10.1.2.3", None)
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("localhost", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("0.0.0.0", KEY) is None


def test_retries_of_one_request_carry_its_id_and_a_failed_call_releases_it():
    """ProducerClient sends one request id for all tries of a call; when every try fails it tells the service
    to release what they may have published."""
    stand_in = StandIn()
    calls = []

    def slow_submit(ids, mask, consumer=None, layout="sample", request_id=None):
        calls.append(request_id)
        time.sleep(1.5)  # longer than the client's timeout
        return StandIn.submit(stand_in, ids, mask, consumer, layout, request_id)

    stand_in.submit = slow_submit
    front, _ = start(stand_in)
    try:
        client = ProducerClient(front.url, timeout=0.5, retries=2, pause=0.05)
        with pytest.raises(ProducerError, match="did not answer after 3 tries"):
            client.request("s", input_ids=[1])
        assert len(calls) == 3 and len(set(calls)) == 1 and calls[0]
        deadline = time.monotonic() + 10
        while not stand_in.released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stand_in.released == calls[:1]
    finally:
        front.stop()


class Recorder:
    """A server on 127.0.0.1 that records every request's line and Authorization header and answers each with
    ``status`` and ``headers`` (a proxy that would forward, or a producer that redirects)."""

    def __init__(self, status: int = 200, headers: dict | None = None):
        self.seen: list[tuple[str, str | None]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _record(self):
                recorder.seen.append((self.requestline, self.headers.get("Authorization")))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = b'{"service": "not the producer"}'
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _record

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # stop: 0.05 s

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy_env(monkeypatch):
    """A recording proxy named by http_proxy (no no_proxy), and urllib's default opener made again from it."""
    proxy = Recorder()
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    urllib.request.install_opener(None)  # urlopen's opener reads the variables anew
    yield proxy
    urllib.request.install_opener(None)
    proxy.stop()


def test_the_client_never_sends_its_requests_or_key_through_a_proxy(keyed, proxy_env):
    """http_proxy set, no no_proxy: ProducerClient's requests, key included, go straight to the producer; the
    proxy sees nothing."""
    front, stand_in = keyed
    client = ProducerClient(front.url, api_key=KEY, retries=0)
    assert client.info() == {"service": "stand-in"}
    assert client.request("s", input_ids=[1, 2])["file"] == "online_0.safetensors"
    assert proxy_env.seen == []


@pytest.mark.parametrize("path", ["/v1/info", "/v1/samples"])
def test_a_redirect_is_refused_naming_where_it_points_and_the_key_goes_nowhere(path):
    """A producer answering 307 to another server: a ProducerError naming the Location, not retried, and the
    other server never sees a request (nor the key)."""
    elsewhere = Recorder()
    redirecting = Recorder(307, {"Location": elsewhere.url + path})
    try:
        client = ProducerClient(redirecting.url, api_key=KEY, retries=3, pause=5)
        started = time.monotonic()
        with pytest.raises(ProducerError) as caught:
            client.info() if path == "/v1/info" else client.request("sample 0", index=0)
        assert time.monotonic() - started < 5  # not retried
        assert f"answered HTTP 307, a redirect to {elsewhere.url}{path}: not followed" in str(caught.value)
        assert elsewhere.seen == [] and len(redirecting.seen) == 1 + (path == "/v1/samples")  # and the release
    finally:
        elsewhere.stop()
        redirecting.stop()
