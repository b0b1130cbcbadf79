"""The tree's layering, checked from the source: no module imports a layer above its own,
torch and triton stay under tools/ and bench/, argparse stays under cli/, only attention/
branches on DCP, and the page size and top-k are defined once."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# lower index = lower layer; a module may import its own layer or a lower one
LAYERS = ("pallas_kernels", "jax_msa_runner.config", "jax_msa_runner.batch",
          "jax_msa_runner.attention", "jax_msa_runner.model", "jax_msa_runner.serving",
          "jax_msa_runner.cli")


def _layer(module: str) -> int | None:
    if module == "jax_msa_runner":  # the package itself: imports nothing
        return 0
    for i, prefix in reversed(list(enumerate(LAYERS))):
        if module == prefix or module.startswith(prefix + "."):
            return i
    if module.startswith("jax_msa_runner."):  # a new top-level module: the model's layer
        return LAYERS.index("jax_msa_runner.model")
    return None


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _package_files():
    for pkg in ("pallas_kernels", "jax_msa_runner"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", list(_package_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_upward(path):
    me = _module_name(path)
    my_layer = _layer(me)
    assert my_layer is not None, me
    for name in _imports(path):
        other = _layer(name)
        assert other is None or other <= my_layer, f"{me} (layer {LAYERS[my_layer]}) imports {name}"


def test_torch_and_triton_only_under_tools_and_bench():
    offenders = [f"{p.relative_to(ROOT)}: {n}" for p in _package_files() for n in _imports(p)
                 if n.split(".")[0] in ("torch", "triton")]
    assert offenders == []


def test_argparse_only_under_cli():
    """The runtime packages take typed configs; flags are parsed in jax_msa_runner/cli/."""
    offenders = [str(p.relative_to(ROOT)) for p in _package_files()
                 if "argparse" in _imports(p)
                 and not str(p.relative_to(ROOT)).startswith("jax_msa_runner/cli/")]
    assert offenders == []
    assert (ROOT / "jax_msa_runner/cli/main.py").exists()


def test_only_attention_branches_on_dcp():
    """The compute path (kernels, model, serving) never branches on DCP: attention/ does.
    batch/ and config.py hold the DCP metadata math and checks; cli/ validates --dcp."""
    allowed = {"jax_msa_runner/attention", "jax_msa_runner/batch", "jax_msa_runner/config.py",
               "jax_msa_runner/cli/"}
    # a branch on whether DCP is on: `if ... world_size > 1`, `... if W == 1 else ...`
    pattern = re.compile(r"\bif\b[^\n]*\b(dcp_world_size|world_size|W)\s*(>|==|!=|<=)\s*1\b")
    offenders = []
    for p in _package_files():
        rel = str(p.relative_to(ROOT))
        if any(rel.startswith(a) for a in allowed):
            continue
        offenders += [f"{rel}: {line.strip()}" for line in p.read_text().splitlines()
                      if pattern.search(line)]
    assert offenders == []


@pytest.mark.parametrize("value, names", [("128", ("PAGE_SIZE", "PAGE", "BLOCK_SIZE")),
                                          ("16", ("TOPK", "MSA_TOPK"))])
def test_page_size_and_topk_defined_once(value, names):
    definition = re.compile(rf"^\s*({'|'.join(names)})\s*(:\s*int)?\s*=\s*{value}\b", re.M)
    sites = [str(p.relative_to(ROOT)) for p in _package_files()
             if definition.search(p.read_text())]
    assert sites == ["pallas_kernels/_shapes.py"]
