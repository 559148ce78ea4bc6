"""The command's process on a CPU build, started again with glibc asked for transparent huge pages."""

import json
import os
import subprocess
import sys

import pytest

from speculators_v016.run import huge_pages
from speculators_v016.run.huge_pages import OPT_OUT, plan, same_invocation

HOST = dict(vllm_version="0.16.0+cpu", thp="madvise", glibc=(2, 36))
HEAP = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483648"
BOTH = f"glibc.malloc.hugetlb=1:{HEAP}"


def test_plan_asks_on_a_cpu_build_with_madvise_huge_pages():
    """A CPU build, THP in madvise mode, glibc 2.35+: huge pages and the kept heap are added, a user's other
    tunables kept first."""
    assert plan({}, **HOST) == BOTH
    assert plan({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **HOST) == f"glibc.malloc.arena_max=2:{BOTH}"


@pytest.mark.parametrize(
    ("env", "host", "expected"),
    [
        ({}, {"thp": "always"}, HEAP),  # the kernel gives huge pages already: the heap kept all the same
        ({}, {"thp": "never"}, HEAP),  # the kernel ignores the advice
        ({}, {"thp": None}, HEAP),
        ({}, {"glibc": (2, 35)}, "glibc.malloc.hugetlb=1"),  # the kept heap measured from 2.36 only
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}, f"glibc.malloc.hugetlb=0:{HEAP}"),  # the user's choice
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {}, f"glibc.malloc.hugetlb=1:{HEAP}"),
        (  # a threshold set through glibc's own variable is the user's too
            {"MALLOC_MMAP_THRESHOLD_": "65536"},
            {},
            "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=2147483648",
        ),
        (  # a threshold the user set is theirs: only the others are added
            {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
            {},
            "glibc.malloc.trim_threshold=0:glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1073741824",
        ),
    ],
)
def test_plan_adds_only_what_this_host_reads_and_the_user_did_not_name(env, host, expected):
    """Huge pages only where THP is in madvise mode and glibc has the tunable; every tunable the user named kept."""
    assert plan(env, **{**HOST, **host}) == expected


@pytest.mark.parametrize(
    ("env", "host"),
    [
        ({OPT_OUT: "0"}, {}),  # the user's opt-out
        ({OPT_OUT: "started"}, {}),  # started again already: never a second time, whatever the tunables became
        ({"GLIBC_TUNABLES": BOTH}, {}),  # every tunable named already
        ({}, {"vllm_version": "0.16.0"}),  # a GPU build: not measured with them
        ({}, {"vllm_version": None}),
        ({}, {"glibc": (2, 31)}),  # neither: hugetlb from 2.35, the kept heap measured from 2.36
        ({}, {"glibc": None}),  # another libc
    ],
)
def test_plan_leaves_the_process_as_it_is(env, host):
    """Where the tunables are not known to be read and to help, or the user chose, nothing changes."""
    assert plan(env, **{**HOST, **host}) is None


def test_the_summary_names_what_the_process_was_given():
    """The run summary's words follow the process's GLIBC_TUNABLES: huge pages, the kept heap, both or neither."""
    assert huge_pages.describe(BOTH).startswith("glibc asked for transparent huge pages and a kept heap")
    assert huge_pages.describe(HEAP).startswith("glibc asked for a kept heap")
    assert huge_pages.describe("glibc.malloc.hugetlb=1").startswith("glibc asked for transparent huge pages (")
    assert huge_pages.describe("glibc.malloc.mmap_threshold=1073741824").startswith("glibc not asked")
    assert huge_pages.heap_kept(BOTH) and not huge_pages.heap_kept("glibc.malloc.trim_threshold=2147483648")


def test_the_hosts_facts_are_read():
    """The kernel's bracketed THP mode and glibc's version string are parsed; anything else is None."""
    assert huge_pages.thp_mode("always [madvise] never\n") == "madvise"
    assert huge_pages.thp_mode("") is None and huge_pages.thp_mode("always madvise never") is None
    assert huge_pages.glibc_version("glibc 2.36") == (2, 36)
    assert huge_pages.glibc_version("musl 1.2") is None and huge_pages.glibc_version("glibc x") is None


def test_only_the_command_s_own_invocation_starts_again():
    """`python -m module args` and a console script start again; a host running the module in itself does not."""
    assert same_invocation(["/py", "-m", "speculators_v016.run.cli", "demo"], ["/x/cli.py", "demo"])
    assert same_invocation(
        ["/py", "/venv/bin/speculators-data-gen", "demo"], ["/venv/bin/speculators-data-gen", "demo"]
    )
    assert not same_invocation(["/py", "tests/helpers/warm_start.py"], ["speculators_v016.run.cli", "demo"])
    assert not same_invocation(["/py", "-m", "pytest"], ["speculators_v016.run.cli"])  # no arguments: no start


PROBE = """
import json, os, resource, sys
from speculators_v016.run import huge_pages
huge_pages.reexec()
import torch
states = torch.ones(64 << 20, dtype=torch.uint8)  # torch's allocator: glibc's malloc, past its mmap ceiling
huge = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
del states
refaults = 0
for step in range(16):  # steps of four 56 MiB tensors alive together (a wide CPU step's aux sums), each made and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    states = [torch.ones(56 << 20, dtype=torch.uint8) for _ in range(4)]
    refaults += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) if step >= 8 else 0  # once warm
    del states
print(json.dumps({"pid": os.getpid(), "tunables": os.environ.get("GLIBC_TUNABLES"), "huge_kib": huge[0],
                  "mark": os.environ.get(huge_pages.OPT_OUT), "refaults": refaults}))
"""


def probe(**env) -> dict:
    """A fresh interpreter that calls :func:`huge_pages.reexec` as the command does, then makes a 64 MiB tensor."""
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    with subprocess.Popen([sys.executable, "-c", PROBE, "x"], stdout=subprocess.PIPE, text=True,
                          env={**base, **env}) as proc:  # fmt: skip
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return {**json.loads(out.strip().splitlines()[-1]), "started_as": proc.pid}


def test_the_process_started_again_gets_huge_pages_and_keeps_its_heap():
    """Where this host takes them: the same pid starts again with the tunables, a fresh tensor lies in huge pages and
    steps of freed and remade tensors, once warm, take no page fault; opted out, it lies in 4 KiB pages and every
    step faults its tensors in again. Where the host takes none: the process is left as it was started."""
    users_env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    asked, plain = probe(), probe(**{OPT_OUT: "0"})
    assert plain["tunables"] is None and plain["pid"] == plain["started_as"]
    assert asked["pid"] == asked["started_as"]  # execve: the same process
    if huge_pages.wanted(users_env) is None:
        assert asked["tunables"] is None
        return
    assert asked["tunables"] == huge_pages.wanted(users_env) and asked["mark"] == "started"
    if huge_pages.TUNABLE in asked["tunables"]:
        assert asked["huge_kib"] >= 32 << 10, asked  # most of the 64 MiB tensor in 2 MiB pages
        assert plain["huge_kib"] < 2 << 10, plain  # the same tensor without the tunable: none
    if huge_pages.heap_kept(asked["tunables"]):  # the kept heap: once warm, a step's tensors lie where the last did
        assert asked["refaults"] < 16, asked
    assert plain["refaults"] >= 8 * 4 * 28, plain  # glibc's own thresholds: new mappings each step, faulted in again


STRIPPING_PROBE = """
import os
from speculators_v016.run import huge_pages
real = os.execve
def execve(path, args, env):  # a start that loses GLIBC_TUNABLES on the way (a loader that filters it)
    env = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    env["PROBE_STARTS"] = str(int(env.get("PROBE_STARTS", "0")) + 1)
    if int(env["PROBE_STARTS"]) > 3:
        raise SystemExit("started again and again")
    real(path, args, env)
os.execve = execve
huge_pages.reexec()
print(os.environ.get("PROBE_STARTS"))
"""


def test_the_process_never_starts_again_twice():
    """Should the tunable be lost on the way, the started-again mark still stops a second start."""
    users_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT, "PROBE_STARTS")}
    proc = subprocess.run([sys.executable, "-c", STRIPPING_PROBE, "x"], capture_output=True, text=True, env=users_env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("1" if huge_pages.wanted(users_env) is not None else "None")
