"""Bad input to `python -m zerompi.estimate` is one line on stderr and exit 2, never a
traceback: each case through the command's main() in this process (the process itself,
exit status and all: tests/system/test_estimate_cli.py)."""
import pytest

from zerompi.estimate.cli import main


@pytest.mark.parametrize("args", [["--dp", "0", "--params", "1e9"], ["--model", "nope"],
                                  ["--config", "no/such.toml"], ["--params", "1e9", "--mem-per-rank", "2XB"],
                                  ["--model", "tiny", "--link", "nope"], ["--model", "tiny", "--alpha", "1e-6"],
                                  ["--model", "tiny", "--stage", "5"], ["--dp", "1,x", "--params", "1e9"],
                                  ["--model", "tiny", "--dry-run", "--tp", "3"], ["--params", "1e9", "--tp", "0"], []])
def test_bad_input_is_one_line(args, capsys):
    assert main(args) == 2, args
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, (args, err)
    assert err.startswith("zerompi.estimate: error: "), err
