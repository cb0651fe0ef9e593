from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl_models import tiny
from rl_models.tokenization import OPTION_LETTERS


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_every_family_of_the_issue_is_registered():
    assert set(tiny.families()) == {
        "qwen3",
        "qwen3_vllm",
        "qwen2_5_vl",
        "qwen3_vl",
        "sd3",
        "janus",
        "wan",
        "cosmos",
        "embedding",
        "clip",
    }


def test_unknown_family_lists_valid_ones():
    with pytest.raises(KeyError, match=r"unknown tiny family 'gpt9'.*qwen3"):
        tiny.build("gpt9")


def test_register_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        tiny.register_family("qwen3", "v1", lambda out: None)


@pytest.mark.parametrize("family", tiny.families())
def test_same_seed_identical_files_other_seed_differs(family, tmp_path):
    a = _digest(tiny.build(family, tmp_path / "a", seed=1))
    b = _digest(tiny.build(family, tmp_path / "b", seed=1))
    c = _digest(tiny.build(family, tmp_path / "c", seed=2))
    assert a == b
    weights = [name for name in a if name.endswith(".safetensors")]
    assert weights and all(a[name] != c[name] for name in weights)


def test_cache_reuse_and_layout(_tiny_cache):
    first = tiny.build("qwen3", seed=7)
    assert first.parent == _tiny_cache
    assert first.name.startswith("qwen3-s7-")
    stamp = (first / "config.json").stat().st_mtime_ns
    again = tiny.build("qwen3", seed=7)
    assert again == first
    assert (again / "config.json").stat().st_mtime_ns == stamp
    # No leftover temporary folders (the lock files live in .locks/).
    assert [p.name for p in _tiny_cache.iterdir() if p.name.startswith(".")] == [".locks"]


def test_concurrent_builds_agree(tmp_path, monkeypatch):
    """Two builders race for the same cache entry: both get the one complete folder."""
    monkeypatch.setenv("RL_MODELS_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = set(pool.map(lambda _: tiny.build("qwen3", seed=11), range(2)))
    assert len(paths) == 1
    folder = paths.pop()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
    assert (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", folder.name]


_TWO_RANKS = """
import os, sys, torch.distributed as dist
from transformers import AutoModelForCausalLM
from rl_models import tiny
dist.init_process_group("gloo")
if dist.get_rank() == 1:  # rank 1 builds first, as when it wins the race on an empty cache
    tiny.build("qwen3", seed=5)
dist.barrier()
folder = tiny.build("qwen3", seed=5)
AutoModelForCausalLM.from_pretrained(folder)
print("loaded", dist.get_rank())
dist.destroy_process_group()
"""


def test_a_secondary_rank_building_first_leaves_a_complete_checkpoint(tmp_path):
    """Under torch.distributed, transformers' save_pretrained writes weights on rank 0 only: a
    cache entry built by rank 1 must still hold them, and every rank then loads it."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "RL_MODELS_CACHE": str(tmp_path / "cache"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**base, "RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
    assert sorted(out.strip() for out, _ in outputs) == ["loaded 0", "loaded 1"]


def test_an_incomplete_cached_folder_is_rebuilt(tmp_path, monkeypatch):
    """A cache entry without its weights (what a lost race of an older version left behind) is
    rebuilt on the next use, not handed to from_pretrained."""
    monkeypatch.setenv("RL_MODELS_CACHE", str(tmp_path))
    folder = tiny.build("qwen3", seed=12)
    (folder / "model.safetensors").unlink()
    again = tiny.build("qwen3", seed=12)
    assert again == folder and (again / "model.safetensors").is_file()
    (folder / ".rl-models-complete.json").unlink()  # a folder from before the manifest
    assert tiny.build("qwen3", seed=12) == folder
    assert (folder / ".rl-models-complete.json").is_file()


def test_qwen3_tokenizer_letters_are_single_tokens(qwen3_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    for letter in OPTION_LETTERS:
        assert len(tok.encode(letter, add_special_tokens=False)) == 1
        assert len(tok.encode(" " + letter, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>"
    for special in ("<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|video_pad|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_qwen3_chat_template(qwen3_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Caption: [00:12] a dog. Answer: A) yes B) no"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCaption: [00:12] a dog. Answer: A) yes B) no<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    no_think = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_resolve_is_the_one_parser_of_model_specs(tmp_path, monkeypatch):
    """`tiny:<family>[:seed]`, a folder, or a hub id; anything else is a user error naming the key
    and what was tried. Offline, a hub id must be in the local cache."""
    from huggingface_hub import constants

    from rl_core.errors import UserError
    from rl_models.tiny import build, resolve

    assert resolve("tiny:qwen3") == str(build("qwen3"))
    assert resolve("tiny:qwen3:1") == str(build("qwen3", seed=1)) != resolve("tiny:qwen3")
    assert resolve(str(tmp_path)) == str(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"model not found: reward\.judge='Qwen/Qwen3-4B' is no local folder \(no "
                       r"such path: .*Qwen/Qwen3-4B\), and as a hub id it is not in the local Hugging Face cache"):
        resolve("Qwen/Qwen3-4B", key="reward.judge")
    with pytest.raises(UserError, match=r"model not found: reward\.judge='/no/such' is no local folder \(no such "
                       r"path: /no/such\)"):
        resolve("/no/such", key="reward.judge")
    with pytest.raises(UserError, match=r"unknown tiny family 'nope'; valid: .*qwen3"):
        resolve("tiny:nope")
    with pytest.raises(UserError, match="must be a number"):
        resolve("tiny:qwen3:x")


class _Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in Hugging Face Hub on 127.0.0.1: knows one model, answers 404 for the others."""

    def do_GET(self) -> None:
        if self.path.startswith("/api/models/Qwen/Qwen3-4B"):
            body = json.dumps({"id": "Qwen/Qwen3-4B", "sha": "0" * 40}).encode()
            self.send_response(200)
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")  # what huggingface.co sends
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_hub_id_online_is_checked_in_one_request(tmp_path, monkeypatch):
    """Online, a hub id that is not cached costs one metadata request: a model the Hub has is
    returned for from_pretrained to download; a missing one, or a Hub that does not answer, is one
    line (never a minute of retries and a traceback)."""
    from huggingface_hub import constants

    from rl_core.errors import UserError
    from rl_models.tiny import resolve

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert resolve("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
        with pytest.raises(UserError, match=r"model\.path='nobody/no-such-model'.* it is not on the Hugging Face Hub"):
            resolve("nobody/no-such-model")
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
    with pytest.raises(UserError, match=r"not in the local Hugging Face cache and the Hub is not reachable .*"
                                        r"HF_HUB_OFFLINE=1"):
        resolve("Qwen/Qwen3-4B")
