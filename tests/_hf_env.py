"""The reference environment (``.venv-vllm``) of tests/hf and of the lm-eval test: where it is
and checks that it is built (``make compare-env``), failing the test (never skipping) when it
is not."""
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
HF_SIDE = os.path.join(REPO, "tools", "hf_reference", "hf_side.py")
TRANSFORMERS_VERSION = "5.23.0"
LM_EVAL_VERSION = "0.4.13"


def _require(dist: str, version: str, imports: str, requirements: str) -> None:
    """pytest.fail unless REF_PYTHON exists, imports ``imports`` and has ``dist==version``."""
    if not os.path.exists(REF_PYTHON):
        pytest.fail(f"{REF_PYTHON} is missing: the reference env is built by `make compare-env` "
                    f"(then {dist}=={version} from {requirements})")
    probe = subprocess.run([REF_PYTHON, "-c", f"import {imports}; import importlib.metadata as m; "
                            f"print(m.version({dist!r}))"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != version:
        pytest.fail(f"{REF_PYTHON} lacks {dist}=={version} "
                    f"({probe.stdout.strip() or probe.stderr.strip()[-300:]}): run `make compare-env`")


def check_reference_env() -> None:
    """pytest.fail unless REF_PYTHON runs transformers==TRANSFORMERS_VERSION (and torch)."""
    _require("transformers", TRANSFORMERS_VERSION, "transformers, torch",
             "tools/hf_reference/requirements.txt")


def check_lm_eval_env() -> None:
    """pytest.fail unless REF_PYTHON runs lm-eval==LM_EVAL_VERSION."""
    _require("lm_eval", LM_EVAL_VERSION, "lm_eval", "tools/lm_eval/requirements.txt")
