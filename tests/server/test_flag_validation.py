"""Flags that would make a useless server are refused at start, in one line (issue 55, item 6).

`--max-model-len -5` started, said ok on /health and refused every request; `--max-model-len 0` meant
"the model's"; `--ep-ranks 16` of `mini` took 21 GB of a 24 GB machine. The in-process tests replace
the listening sockets' bind with a failure, so a flag that is not refused fails the test at once
instead of starting a server.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from locus.cli import build_parser, main
from locus.errors import LocusError
from locus.server.cli import SERVE_FLAGS
from locus.server.fit import PROCESS_OVERHEAD_BYTES, LaunchMemory, check_fits
from tests.server.server_process import free_port
from tests.server.test_startup_shutdown import assert_one_line, failed_start, serving_processes


@pytest.fixture
def no_listening(monkeypatch):
    """A start that gets past the flag checks stops where it would bind its port."""
    import locus.server.lifecycle as lifecycle

    def refuse(host, port):
        raise AssertionError("the flags were accepted: the server went on to bind its port")

    monkeypatch.setattr(lifecycle, "bind_listeners", refuse)
    monkeypatch.setenv("LOCUS_DEBUG", "0")


def refusal(capsys, *flags: str) -> str:
    """`locus serve FLAGS` must exit 2 with one line; that line."""
    code = main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert_one_line(err, "locus: error: ")
    return err.strip()


BAD_VALUES = [
    ("--port", "-1"), ("--port", "65536"),
    ("--seed", str(1 << 64)),
    ("--max-num-seqs", "0"), ("--max-num-seqs", "-1"),
    ("--max-num-batched-tokens", "0"),
    ("--max-model-len", "0"), ("--max-model-len", "-5"),
    ("--kv-cache-memory", "0"), ("--kv-cache-memory", "-1GiB"),
    ("--num-kv-blocks", "0"),
    ("--block-size", "0"), ("--block-size", "-16"),
    ("--max-waiting", "0"),
    ("--burst-wait-ms", "-1"), ("--burst-wait-ms", "1001"), ("--burst-wait-ms", "nan"), ("--burst-wait-ms", "inf"),
    ("--max-grammar-bytes", "0"),
    ("--max-grammar-compile-seconds", "0"), ("--max-grammar-compile-seconds", "nan"),
    ("--max-grammar-compile-seconds", "inf"),
    ("--grammar-cache-bytes", "-1"),
    ("--trace-max-bytes", "0"),
    ("--max-request-body-bytes", "0"),
    ("--max-prompts-per-request", "0"),
    ("--max-stop-chars", "0"),
    ("--max-logit-bias", "-1"),
    ("--max-logprob-entries", "-1"),
    ("--ep-ranks", "0"), ("--ep-ranks", "-2"),
    ("--gpus-per-node", "0"),
    ("--ep-timeout", "0"), ("--ep-timeout", "-1"), ("--ep-timeout", "nan"), ("--ep-timeout", "inf"),
    ("--ep-max-tokens-per-rank", "0"),
    ("--ep-loop-nice", "-1"), ("--ep-loop-nice", "20"),
    ("--ep-max-slots", "0"),
    ("--replan-window", "0"),
    ("--replan-layers-per-step", "0"),
    ("--graceful-timeout", "-1"), ("--graceful-timeout", "nan"), ("--graceful-timeout", "inf"),
]


@pytest.mark.parametrize("flag,value", BAD_VALUES)
def test_every_numeric_flag_out_of_range_is_one_line_naming_it(flag, value, capsys, no_listening):
    line = refusal(capsys, f"{flag}={value}")
    assert line.startswith(f"locus: error: {flag} must be ") and ", not " in line, line


def numeric_flags() -> set[str]:
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    sizes = {"--kv-cache-memory", "--grammar-cache-bytes", "--trace-max-bytes", "--max-request-body-bytes"}
    return {a.option_strings[0] for a in serve._actions if a.type in (int, float)} | sizes


def test_the_table_names_every_numeric_flag_and_the_tests_try_each():
    table = {spec.flag for spec in SERVE_FLAGS}
    assert numeric_flags() == table
    assert {flag for flag, _ in BAD_VALUES} == table


def test_a_bad_flag_is_refused_before_torch_is_imported():
    code = ("import sys; from locus.cli import main; "
            "rc = main(['serve', '--port', '0', '--max-model-len', '-5']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert_one_line(out.stderr, "--max-model-len must be at least 1, not -5")


def test_max_model_len_above_the_models_is_refused(capsys, no_listening):
    line = refusal(capsys, "--max-model-len", "4097")  # tiny's context is 4096
    assert line == "locus: error: --max-model-len must be between 1 and 4096 (the context of model 'tiny'), not 4097"
    # the model's own length is accepted: the start goes on to bind its port
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0", "--max-model-len", "4096"]) == 1
    assert "went on to bind" in capsys.readouterr().err


def test_ranks_whose_kv_pools_exceed_the_machine_are_refused_with_the_figures(capsys, no_listening):
    line = refusal(capsys, "--ep-ranks", "4", "--kv-cache-memory", "1000000GiB")  # never allocated
    assert "4 ranks x " in line and "a KV pool of 1000000.00 GiB" in line and "(MemAvailable)" in line, line
    assert "--kv-cache-memory" in line and "--ep-ranks" in line, line


def test_the_fit_figures():
    need = LaunchMemory(ranks=16, kv_bytes=1 << 30, weight_bytes=14 << 20)
    check_fits(need, need.total)  # exactly enough
    check_fits(need, None)  # no /proc/meminfo: nothing to compare with
    with pytest.raises(LocusError) as refused:
        check_fits(need, need.total - 1)
    per_rank = ((1 << 30) + (14 << 20) + PROCESS_OVERHEAD_BYTES) / (1 << 30)
    assert f"16 ranks x {per_rank:.2f} GiB" in str(refused.value)
    assert f"about {16 * per_rank:.2f} GiB" in str(refused.value)


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_bad_max_model_len_exits_at_once_and_leaves_nothing(value):
    port = str(free_port())
    code, err = failed_start("--port", port, "--max-model-len", value)
    assert code == 2, err
    assert_one_line(err, f"--max-model-len must be at least 1, not {value}")
    assert serving_processes(f"--port {port}") == []
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(port))) != 0


@pytest.mark.slow  # a `locus serve --ep-ranks` process (refused before any rank starts)
def test_an_ep_launch_over_the_machines_memory_starts_no_rank():
    port = str(free_port())
    code, err = failed_start("--port", port, "--device", "cpu", "--ep-ranks", "2", "--kv-cache-memory", "1000000GiB")
    assert code == 2, err
    assert_one_line(err, "2 ranks x", "MemAvailable", "--kv-cache-memory", "--ep-ranks")
    assert serving_processes(f"--port {port}") == []
