"""``python -m jax_msa_runner.cli [subcommand] [flags]``: the same as ``jax-msa-runner``."""
import sys

from jax_msa_runner.cli.main import main

sys.exit(main())
