"""The command-line front ends: ``jax-msa-runner`` and its subcommands (the only package
that parses flags).

- main: the ``jax-msa-runner`` parser and dispatch (demo, serve, logits, buckets, lower).
- demo: the tiny default model (or a checkpoint) serving a synthetic workload.
- serve: the OpenAI-compatible HTTP server's flags and start-up.
- logits: a checkpoint's logits on given token ids (the parity tools read these).
- lower: the StableHLO of one forward step for an abstract H200 (which kernels it runs).
- flags, mesh_flags: bounded flag types and the mesh / distributed flags they share.
"""
from jax_msa_runner.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
