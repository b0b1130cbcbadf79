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


def check_reference_env() -> None:
    """pytest.fail unless REF_PYTHON runs transformers==TRANSFORMERS_VERSION."""
    if not os.path.exists(REF_PYTHON):
        pytest.fail(f"{REF_PYTHON} is missing: the transformers reference env is built by "
                    f"`make compare-env` (then transformers=={TRANSFORMERS_VERSION} from "
                    f"tools/hf_reference/requirements.txt)")
    probe = subprocess.run([REF_PYTHON, "-c", "import transformers, torch; "
                            "print(transformers.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != TRANSFORMERS_VERSION:
        pytest.fail(f"{REF_PYTHON} lacks transformers=={TRANSFORMERS_VERSION} "
                    f"({probe.stdout.strip() or probe.stderr.strip()[-300:]}): run `make compare-env`")


def check_lm_eval_env() -> None:
    """pytest.fail unless REF_PYTHON runs lm-eval==LM_EVAL_VERSION."""
    probe = subprocess.run([REF_PYTHON, "-c", "import importlib.metadata as m; "
                            "print(m.version('lm_eval'))"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != LM_EVAL_VERSION:
        pytest.fail(f"{REF_PYTHON} lacks lm-eval=={LM_EVAL_VERSION} "
                    f"({probe.stdout.strip() or probe.stderr.strip()[-300:]}): run `make compare-env`")
