import subprocess
import sys

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
