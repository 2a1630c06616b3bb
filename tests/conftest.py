"""Test-wide settings: no network (and no proxy between the tests and the servers they start on
127.0.0.1), torch threads sized to the work, and CPU kernel plans measured by the tests kept in a
file of their own (not the user's cache, whose plans they would join).

Tiny models run fastest on one thread (thread start-up dominates their matrix products, and on a
busy 2-core machine two threads wait on each other); the real default model uses two where its process has
two cores to itself.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a proxy the environment names (http_proxy, as CI runners may set) is not asked for 127.0.0.1: httpx and urllib
# read no_proxy at each request (distillation's opener took http_proxy when it was imported)
for _name in ("no_proxy", "NO_PROXY"):
    os.environ[_name] = ",".join(filter(None, (os.environ.get(_name), "127.0.0.1", "localhost")))
# httpx (and the openai client on it) makes a transport for every proxy the environment names as a client is made,
# even where no_proxy exempts every host asked: a SOCKS one (ALL_PROXY=socks5://..., as SSH tunnels and VPN clients
# set) failed every client with an ImportError (no socksio); the tests reach no host through it
for _name in ("all_proxy", "ALL_PROXY"):
    if os.environ.get(_name, "").lower().startswith("socks"):
        del os.environ[_name]
if "MEDUSA_FORGE_KERNEL_PLANS" not in os.environ:  # (pytest-xdist's workers take the one the first process made)
    os.environ["MEDUSA_FORGE_KERNEL_PLANS"] = os.path.join(tempfile.mkdtemp(prefix="medusa-forge-tests-"),
                                                           "cpu-kernel-plans.json")


#: the cores each test process has: all of them, or their share among pytest-xdist's workers (``make test`` runs
#: two): a real-model test on two threads beside another worker's test waited on its descheduled thread (8x slower)
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def _torch_threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(min(2, CORES) if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(previous)
