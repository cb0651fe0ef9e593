import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import rl_data


def test_choices_import_loads_no_heavy_dependency():
    code = ("import sys, rl_data.choices, rl_data.records; "
            "print(sorted(m for m in ('pyarrow', 'av', 'numpy', 'PIL') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_exports_resolve_and_unknown_name_raises():
    assert rl_data.GroupSampler.__module__ == "rl_data.sampler"
    assert rl_data.read_caption_qa.__module__ == "rl_data.readers"
    assert set(rl_data.__all__) <= set(dir(rl_data))
    for name in rl_data.__all__:
        getattr(rl_data, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rl_data.nope  # noqa: B018


def test_base_install_reads_files_without_datasets(tmp_path):
    """`pip install rl-data` has no `datasets`: every module imports, files read, and a dataset
    asks for the extra by its install command."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    code = f"""
import sys
sys.modules["datasets"] = None  # as if not installed: `import datasets` raises ImportError
import rl_data, rl_data.cli, rl_data.hf, rl_data.sources, rl_data.writers
from rl_data import open_source, read_caption_qa
assert len(list(open_source("examples/data/prompts.jsonl", kind="prompts"))) == 8
assert len(list(read_caption_qa("examples/data/caption_qa_images.jsonl"))) == 16
try:
    read_caption_qa({str(tmp_path / "ds")!r})
except ImportError as exc:
    print(exc)
"""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == ('reading Hugging Face datasets needs the `datasets` extra: pip install "rl-data[datasets]"; '
                                  'in a clone of the repository: uv sync --all-packages --extra datasets')


def test_no_module_imports_datasets_until_a_dataset_is_read():
    code = ("import sys, rl_data, rl_data.cli, rl_data.hf, rl_data.sources, rl_data.readers, rl_data.sampler; "
            "[getattr(rl_data, n) for n in rl_data.__all__]; print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _closure(lock: dict, name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Every package `name` (with `extras`) pulls in, per uv.lock (markers ignored: all platforms)."""
    packages = {p["name"]: p for p in lock["package"]}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        package = packages[current]
        deps = list(package.get("dependencies", []))
        for extra in wanted:
            deps += package.get("optional-dependencies", {})[extra]
        for dep in deps:
            key = (dep["name"], tuple(dep.get("extra", ())))
            if key not in seen:
                seen.add(key)
                todo.append(key)
    return {dep for dep, _ in seen}


def test_base_install_does_not_pull_in_datasets():
    lock = tomllib.loads((Path(__file__).resolve().parents[3] / "uv.lock").read_text())
    assert "datasets" not in _closure(lock, "rl-data")
    assert {"datasets", "pandas"} <= _closure(lock, "rl-data", ("datasets",))
