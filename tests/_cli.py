"""What the CLI tests share: a command refused with one stderr line and exit status 2, and
the arguments of a tiny demo run."""
import pytest

from jax_msa_runner.cli.main import main

# `demo` on tiny settings: 3 short requests of 3 output tokens, 2 layers, 2 rows per step
TINY_DEMO = ["demo", "--num-requests", "3", "--long-prompts", "0", "--max-model-len", "512",
             "--output-len", "3", "--num-layers", "2", "--max-num-batched-tokens", "8",
             "--max-num-seqs", "2"]


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
