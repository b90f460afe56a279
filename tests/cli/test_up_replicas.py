"""``specdec up --drafters N --verifiers M --state FILE`` as real processes, and
the orchestrator's backend flags (static lists, DNS names)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from running_stack import alive
from specdec.cli.main import main
from specdec.client import SpecdecClient

PROMPT = "def add(a, b):"


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}




def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_state_file_and_only_the_orchestrator_dying_ends_up(tiny_family, tmp_path):
    state_file = tmp_path / "stack.json"
    state_file.write_text("stale")                 # from an earlier run: must not pass for this one
    err = open(tmp_path / "up.err", "w+")
    cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(tiny_family["target"]),
           "--ngram", "--drafters", "2", "--verifiers", "2", "--state", str(state_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env())

    def stderr():
        err.flush()
        err.seek(0)
        return err.read()

    pids = []
    try:
        line = proc.stdout.readline().strip()       # printed once everything is ready
        assert line.startswith("specdec up: orchestrator on 127.0.0.1:"), stderr()[-2000:]
        state = json.loads(state_file.read_text())
        assert set(state) == {"orchestrator", "drafters", "verifiers"}
        assert len(state["drafters"]) == 2 and len(state["verifiers"]) == 2
        backends = state["drafters"] + state["verifiers"]
        for child in backends:
            assert set(child) == {"addr", "pid"} and isinstance(child["pid"], int) and alive(child["pid"])
            assert child["addr"].startswith("127.0.0.1:") and child["addr"] in line
        addresses = [c["addr"] for c in backends] + [state["orchestrator"]]
        assert len(set(addresses)) == 5 and state["orchestrator"] in line
        pids = [c["pid"] for c in backends]
        with SpecdecClient(state["orchestrator"], timeout=60) as client:
            want = client.complete(PROMPT, max_new_tokens=16).token_ids
            # a drafter and a verifier die: `up` reports each and keeps serving
            for role in ("drafters", "verifiers"):
                victim = state[role][0]
                os.kill(victim["pid"], signal.SIGKILL)
                wait_for(lambda: f"(pid {victim['pid']}) exited with status -9" in stderr(), 10, "the report")
                assert proc.poll() is None
                assert client.complete(PROMPT, max_new_tokens=16).token_ids == want
        assert "1 drafter(s) left" in stderr() and "1 verifier(s) left" in stderr()
        # the orchestrator dies: `up` ends non-zero and takes the rest down
        orchestrator_pid = next(int(p) for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if int(p) not in pids)
        os.kill(orchestrator_pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "specdec up: the orchestrator exited with status -9; stopping the others" in stderr()
        wait_for(lambda: not any(alive(p) for p in pids), 30, "the backends to stop")
        assert not state_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        err.close()


@pytest.mark.timeout(300)
def test_startup_failure_of_one_replica_names_it(tiny_family, tmp_path):
    broken = tmp_path / "broken-lm"
    broken.mkdir()
    (broken / "config.json").write_text(Path(tiny_family["draft-lm"], "config.json").read_text())
    cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(tiny_family["target"]),
           "--draft-lm", str(broken), "--drafters", "2", "--state", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env())
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specdec up:")]
    assert len(lines) == 1 and "exited with status" in lines[0], proc.stderr[-2000:]
    assert lines[0].startswith(("specdec up: the drafter-1 ", "specdec up: the drafter-2 "))
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("flags,needle", [(["--verifiers", "0"], "--verifiers"), (["--drafters", "-1"], "--drafters")])
def test_up_rejects_bad_replica_counts_in_one_line(tiny_family, capsys, flags, needle):
    assert main(["up", "--target", str(tiny_family["target"]), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


# -- the orchestrator's backend flags ----------------------------------------------------------------
def parse(*argv):
    import argparse

    from specdec.cli.stack import add_orchestrator_parser, orchestrator_config

    parser = argparse.ArgumentParser()
    add_orchestrator_parser(parser.add_subparsers(dest="command"))
    return orchestrator_config(parser.parse_args(["orchestrator", "serve", *argv]))


def test_backend_lists_repeat_or_comma_separate(monkeypatch):
    monkeypatch.delenv("SPECDEC_VERIFIER", raising=False)
    monkeypatch.delenv("SPECDEC_DRAFTER", raising=False)
    cfg = parse("--verifier", "a:1,b:2", "--verifier", "c:3", "--drafter", "d:4")
    assert cfg.verifier == ("a:1", "b:2", "c:3") and cfg.drafter == ("d:4",)
    assert cfg.verifier_dns is None and cfg.resolve_interval_s == 10.0
    monkeypatch.setenv("SPECDEC_VERIFIER", "e:5,f:6")
    assert parse().verifier == ("e:5", "f:6")


def test_a_dns_name_is_enough(monkeypatch):
    monkeypatch.delenv("SPECDEC_VERIFIER", raising=False)
    cfg = parse("--verifier-dns=verifier-headless.ns.svc.cluster.local:50051",
                "--drafter-dns=drafter-headless.ns.svc.cluster.local:50051", "--resolve-interval-s", "3")
    assert cfg.verifier == () and cfg.verifier_dns == "verifier-headless.ns.svc.cluster.local:50051"
    assert cfg.drafters.configured and cfg.resolve_interval_s == 3.0


@pytest.mark.parametrize("argv,needle", [
    ([], "--verifier HOST:PORT or --verifier-dns"),
    (["--verifier", "nohost"], "HOST:PORT"),
    (["--verifier-dns", "svc"], "HOST:PORT"),
    (["--verifier", "a:1", "--resolve-interval-s", "0"], "--resolve-interval-s"),
])
def test_backend_flag_errors(monkeypatch, argv, needle):
    from specdec.request.errors import UsageError

    monkeypatch.delenv("SPECDEC_VERIFIER", raising=False)
    monkeypatch.delenv("SPECDEC_VERIFIER_DNS", raising=False)
    with pytest.raises(UsageError, match=needle):
        parse(*argv)


def test_the_plane_is_direct_unless_steps_are_unary_or_relay_is_asked(monkeypatch):
    monkeypatch.delenv("SPECDEC_PLANE", raising=False)
    monkeypatch.delenv("SPECDEC_VERIFIER", raising=False)
    assert parse("--verifier", "a:1").plane == "direct"
    assert parse("--verifier", "a:1", "--unary-steps").plane == "relay"       # unary steps go through it
    assert parse("--verifier", "a:1", "--plane", "relay").plane == "relay"
    monkeypatch.setenv("SPECDEC_PLANE", "relay")
    assert parse("--verifier", "a:1").plane == "relay"


def test_unary_steps_on_the_direct_plane_are_refused():
    from orchestrator.service import OrchestratorConfig

    with pytest.raises(ValueError, match="relay plane"):
        OrchestratorConfig(verifier="127.0.0.1:1", session_streams=False, plane="direct")
    assert OrchestratorConfig(verifier="127.0.0.1:1", session_streams=False, plane="relay").plane == "relay"
