"""The tests' warm parent (tests/forkserver.py) gives what a fresh interpreter running the
installed console script gives: the same exit status, stdout and stderr, in the caller's cwd and
environment."""
import os
import subprocess

from conftest import BIN, ROOT, run_cli


def _fresh(*args, cwd=ROOT, env=None):
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_forked_run_equals_a_fresh_interpreter(tmp_path):
    for args in (("h2c", "--help"), ("h2x", "run", str(tmp_path / "missing"))):
        forked, fresh = run_cli(*args, cwd=tmp_path), _fresh(*args, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == \
            (fresh.returncode, fresh.stdout, fresh.stderr), args
    assert forked.returncode == 2 and "Traceback" not in forked.stderr


def test_forked_run_gets_the_callers_cwd_and_environment(tmp_path):
    (tmp_path / "model.py").write_text(
        "import os\nprint('probe', os.environ.get('H2_FORK_PROBE'), os.getcwd(), flush=True)\n"
        "raise SystemExit('stop here')\n")
    env = dict(os.environ, H2_FORK_PROBE="seen")
    r = run_cli("h2c", "ir", "model.py", cwd=tmp_path, env=env)
    assert f"probe seen {tmp_path}" in r.stdout, (r.stdout, r.stderr)
    assert r.returncode == 2 and "model.py" in r.stderr and "Traceback" not in r.stderr
    assert "H2_FORK_PROBE" not in os.environ          # the test process's own is untouched
