from __future__ import annotations

import json

from typer.testing import CliRunner

from rl_models.cli import app

runner = CliRunner()


def test_tiny_command_writes_loadable_checkpoint(tmp_path):
    result = runner.invoke(app, ["tiny", "qwen3", str(tmp_path / "q"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert (tmp_path / "q" / "model.safetensors").is_file()


def test_tiny_unknown_family_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["tiny", "gpt9", str(tmp_path)])
    assert result.exit_code != 0
    assert "unknown tiny family" in result.output


def test_shape_config_only(tmp_path):
    result = runner.invoke(app, ["shape", "qwen3", "4b", str(tmp_path), "--config-only"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (2560, 36)
