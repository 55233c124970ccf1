import subprocess
import sys
from pathlib import Path

from featcache import __version__
from featcache.cli import main


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "featcache", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"featcache {__version__}"
    out = subprocess.run([sys.executable, "-m", "featcache", "--help"],
                         capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "exit codes" in out.stdout


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: featcache" in capsys.readouterr().out


def test_demo_serves_every_image_once_and_bit_identical(tmp_path, capsys):
    assert main(["demo", "--turns", "5", "--cache-dir", str(tmp_path / "s"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "30 image requests, 5 encoder runs (5 distinct images)" in out
    assert "bit-identical to a fresh encoding: 5/5" in out
    assert "After a restart" in out


def test_demo_json_is_one_object_a_script_can_read(tmp_path, capsys):
    import json

    assert main(["demo", "--turns", "3", "--cache-dir", str(tmp_path / "s"), "--device", "cpu",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # nothing else on stdout
    assert report["ok"] and report["encoder_runs"] == 3 and report["bit_identical"] == 3
    assert [t["encoded"] for t in report["runs"]["first"]] == [1, 1, 1]
    assert sum(t["encoded"] for t in report["runs"]["after_restart"]) == 0
    assert report["tiers"]["disk"]["entries"] == 3


def test_readme_test_command_is_what_ci_runs():
    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    ci = (root / ".ci/run").read_text()
    assert "<!-- test-command" in text and "python3 -m pytest" in text
    assert "awk" in ci and "test-command" in ci
