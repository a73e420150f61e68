"""bench/ep_network.py's token bucket for the shaped link: the default rule, one frame, a byte count,
and a bad value refused by name before anything is built."""

import subprocess
import sys

import pytest

from tests.bench.bench_scripts import BENCH

sys.path.insert(0, str(BENCH))

import ep_network  # noqa: E402


def test_the_bucket_follows_the_option():
    assert ep_network.bucket_bytes("2846kbit") == 4096  # 10 ms of the rate is less than 4 KiB
    assert ep_network.bucket_bytes("20mbit") == 25000  # 10 ms of 2.5 MB/s
    assert ep_network.bucket_bytes("2846kbit", "packet") == ep_network.PACKET_BUCKET == 1600
    assert ep_network.bucket_bytes("2846kbit", "3000") == 3000


@pytest.mark.parametrize("bad", ["tiny", "100", "-5"])
def test_a_bad_bucket_is_refused_before_the_network_is_built(bad):
    done = subprocess.run([sys.executable, str(BENCH / "ep_network.py"), "--bucket", bad], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and f"--bucket {bad!r}" in done.stderr and "namespace" not in done.stderr
