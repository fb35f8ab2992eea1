"""`kvmesh model`: the bundled SmolLM2 exported as a Hugging Face directory computes what its
GGUF file does (in transformers, and loaded back by kvmesh); and every model a service cannot
serve is refused at start, exit 2, with a message naming the setting, the file and what is
supported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvmesh.main import main
from shared.engine.torch.loader import LoadedModel, load_model
from shared.model.catalog import ModelSource
from tests.checkpoints import hf_checkpoint
from tests.engine.test_checkpoints import logits
from tests.procs import REPO

CHAT = "<|im_start|>user\nWhich berth is free today?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    state = tmp_path_factory.mktemp("state")
    to = tmp_path_factory.mktemp("export") / "smollm2"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVMESH_STATE_DIR", str(state))
        assert main(["model", "export", "smollm2-135m-instruct", "--to", str(to)]) == 0
    return to, state


@pytest.fixture(scope="module")
def bundled(exported: tuple[Path, Path]) -> LoadedModel:
    return load_model("smollm2-135m-instruct", exported[1])


def test_the_export_computes_what_the_gguf_does_in_transformers(
    exported: tuple[Path, Path], bundled: LoadedModel
) -> None:
    import transformers

    to, _ = exported
    ids = bundled.tokenizer.encode(CHAT, add_special_tokens=False).ids
    theirs = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(to)
    assert tok(CHAT, add_special_tokens=False)["input_ids"] == ids
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == bundled.chat_template.render([{"role": "user", "content": "hi"}])
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
        made = theirs.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    diff = (logits(bundled, ids) - expected).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff}"
    from tests.engine.test_checkpoints import greedy

    assert greedy(bundled, ids, 10) == made[0, len(ids) :].tolist()


def test_the_export_loads_back_as_the_same_model(
    exported: tuple[Path, Path], bundled: LoadedModel
) -> None:
    to, state = exported
    back = load_model(ModelSource("smollm2-hf", "hf", to), state)
    ids = bundled.tokenizer.encode(CHAT, add_special_tokens=False).ids
    torch.testing.assert_close(logits(back, ids), logits(bundled, ids), rtol=0, atol=1e-5)
    assert back.config.eos_ids == bundled.config.eos_ids
    assert back.config.fingerprint != bundled.config.fingerprint  # (other files, other name)


def _worker(models: dict[str, str], name: str, state: Path) -> subprocess.CompletedProcess:
    """A prefill worker started with ``name`` from ``models`` (no NATS: refused first)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "KVMESH_STATE_DIR": str(state),
        "KVMESH_MODELS": json.dumps(models),
        "KVMESH_PREFILL_MODEL": name,
        "KVMESH_NATS_URL": "nats://127.0.0.1:1",
    }
    return subprocess.run(
        [sys.executable, "-m", "services.prefill"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _broken(tmp_path: Path, kind: str) -> Path:
    """A model path broken in one way."""
    if kind == "missing":
        return tmp_path / "nope"
    if kind == "not-a-model":
        (tmp_path / "notes.txt").write_text("not a model")
        return tmp_path / "notes.txt"
    if kind == "no-config":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    d = tmp_path / "hf"
    hf_checkpoint(d, "llama")
    if kind == "architecture":
        config = json.loads((d / "config.json").read_text())
        config["architectures"] = ["GPTNeoXForCausalLM"]
        (d / "config.json").write_text(json.dumps(config))
    elif kind == "no-tokenizer":
        (d / "tokenizer.json").unlink()
    elif kind == "no-template":
        (d / "tokenizer_config.json").write_text("{}")
    elif kind == "no-weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    elif kind == "rope":
        config = json.loads((d / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
        (d / "config.json").write_text(json.dumps(config))
    return d


BROKEN = {
    "missing": "no such file or directory",
    "not-a-model": "not a GGUF file",
    "no-config": "no config.json",
    "architecture": "'GPTNeoXForCausalLM' is not supported (supported: LlamaForCausalLM",
    "no-tokenizer": "no tokenizer.json",
    "no-template": "no chat template",
    "no-weights": "no *.safetensors",
    "rope": "rope_scaling 'yarn' is not supported (supported: default, linear, llama3)",
}


def test_a_model_a_worker_cannot_serve_stops_it_at_start(tmp_path: Path) -> None:
    """Each way a model can be broken, a worker of its own (started at once): exit 2 at
    start, naming the setting, the path and what is wrong."""
    for kind in BROKEN:
        (tmp_path / kind).mkdir()
    paths = {kind: _broken(tmp_path / kind, kind) for kind in BROKEN}

    def run(kind: str) -> subprocess.CompletedProcess:
        return _worker({"mine": str(paths[kind])}, "mine", tmp_path / kind / "state")

    with ThreadPoolExecutor(len(BROKEN)) as pool:
        runs = dict(zip(BROKEN, pool.map(run, BROKEN), strict=True))
    for kind, says in BROKEN.items():
        stderr, path = runs[kind].stderr, paths[kind]
        assert runs[kind].returncode == 2, (kind, stderr)
        assert "KVMESH_PREFILL_MODEL=mine" in stderr, (kind, stderr)
        assert f"KVMESH_MODELS[mine] ({path})" in stderr, (kind, stderr)
        assert says in stderr, (kind, stderr)


def test_an_unknown_model_name_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    run = _worker({}, "gpt-9", tmp_path / "state")
    assert run.returncode == 2
    assert "unknown model 'gpt-9'" in run.stderr and "smollm2-135m-instruct" in run.stderr


def test_a_gguf_of_an_unsupported_tokenizer_or_tensor_type_is_refused(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")  # SentencePiece: not a byte-level BPE
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    run = _worker({"odd": str(path)}, "odd", tmp_path / "state")
    assert run.returncode == 2 and "tokenizer 'llama' is not supported" in run.stderr
    del GGMLQuantizationType


def test_the_cli_checks_a_model_and_refuses_an_export_it_cannot_make(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "hf"
    hf_checkpoint(d, "qwen3")
    monkeypatch.setenv("KVMESH_MODELS", json.dumps({"mine": str(d), "gone": str(tmp_path / "x")}))
    assert main(["model", "check", "mine"]) == 0
    assert "mine: servable (hf" in capsys.readouterr().out
    assert main(["model", "check", "gone"]) == 2
    assert main(["model", "export", "mine", "--to", str(tmp_path / "out")]) == 2
    assert "only a GGUF model is exported" in capsys.readouterr().err
    assert main(["model", "export", "tiny-moe", "--to", str(tmp_path / "out")]) == 2
    assert main(["model", "list"]) == 0
    listed = capsys.readouterr().out
    assert "mine" in listed and str(d) in listed and "smollm2-135m-instruct" in listed
    shutil.rmtree(d)
