"""The CLI tests' shared check: a command refused with one stderr line and exit status 2."""
import pytest

from jax_msa_runner.cli import main


def refused(argv, capsys) -> str:
    """Runs ``main(argv)``, expects exit status 2, nothing on stdout and no traceback;
    returns the one stderr line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
