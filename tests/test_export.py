"""common.export: the final weights round-trip into a plain model, load without accelerate, and publish atomically."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.accelerator import build_accelerator
from common.errors import SaveError, UsageError
from common.export import export_info, export_weights, load_exported, publish_export
from conftest import REPO, clean_env


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

    def forward(self, x):
        return self.net(x)


class TiedLM(torch.nn.Module):
    """An embedding shared with the output layer, as language models tie them."""

    def __init__(self, vocab: int = 11, dim: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.norm(self.embed(tokens)))


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def accelerator(fresh_accelerate):
    return build_accelerator(seed=0)


def exported(accelerator, model: torch.nn.Module, path: Path, **kwargs) -> tuple[Path, dict]:
    """Export `model` (prepared) and return the path and its weights as trained."""
    prepared = accelerator.prepare(model)
    state = {k: v.detach().clone() for k, v in accelerator.unwrap_model(prepared).state_dict().items()}
    return export_weights(accelerator, prepared, path, **kwargs), state


def test_export_round_trip_into_a_plain_model(accelerator, tmp_path):
    torch.manual_seed(0)
    path, trained = exported(accelerator, Tiny(), tmp_path / "out" / "model.safetensors", info={"width": 8})
    assert path.is_file() and not list(path.parent.glob(".tmp-*"))
    torch.manual_seed(1)
    plain = Tiny()
    assert not same_tensors(plain.state_dict(), trained)
    load_exported(plain, path)
    assert same_tensors(plain.state_dict(), trained)
    assert export_info(path) == {"width": 8}


def test_export_of_tied_weights_stores_the_tensor_once(accelerator, tmp_path):
    torch.manual_seed(0)
    path, trained = exported(accelerator, TiedLM(), tmp_path / "model.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        tied = json.loads(handle.metadata()["tied"])
    assert keys == {"embed.weight", "norm.weight", "norm.bias"}  # out.weight is not stored a second time
    assert tied == {"out.weight": "embed.weight"}
    torch.manual_seed(1)
    plain = TiedLM()
    load_exported(plain, path)
    assert same_tensors(plain.state_dict(), trained)
    assert plain.out.weight is plain.embed.weight  # still one parameter after loading


def test_load_exported_refuses_a_model_of_another_shape(accelerator, tmp_path):
    path, _ = exported(accelerator, Tiny(), tmp_path / "model.safetensors")
    with pytest.raises(UsageError, match=r"does not fit this model: shape of net.0.weight is \(8, 4\), "
                                         r"the model has \(16, 4\)"):
        load_exported(Tiny(width=16), path)
    with pytest.raises(UsageError, match="does not fit this model: missing"):
        load_exported(TiedLM(), path)


def test_load_exported_refuses_a_file_that_is_not_an_export(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UsageError, match="not a readable safetensors export"):
        load_exported(Tiny(), tmp_path / "model.safetensors")
    with pytest.raises(UsageError, match="not a readable safetensors export"):
        load_exported(Tiny(), tmp_path / "missing.safetensors")


# A process where accelerate (and transformers) cannot be imported, as in an inference service with torch and
# safetensors only: it loads the export (argv: repo, export, where to save what it loaded).
WITHOUT_ACCELERATE = textwrap.dedent("""
    import json, sys
    for name in ("accelerate", "transformers"):
        sys.modules[name] = None  # `import accelerate` now raises ImportError, as where it is not installed
    sys.path.insert(0, sys.argv[1])
    import torch
    from common.export import export_info, load_exported

    class TiedLM(torch.nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.norm = torch.nn.LayerNorm(dim)
            self.out = torch.nn.Linear(dim, vocab, bias=False)
            self.out.weight = self.embed.weight

    info = export_info(sys.argv[2])
    model = TiedLM(**info["model"])
    load_exported(model, sys.argv[2])
    assert model.out.weight is model.embed.weight
    torch.save(model.state_dict(), sys.argv[3])
    print(json.dumps(info))
""")


def test_an_export_loads_in_a_process_where_accelerate_cannot_be_imported(accelerator, tmp_path):
    torch.manual_seed(0)
    info = {"model": {"vocab": 11, "dim": 4}}
    path, trained = exported(accelerator, TiedLM(), tmp_path / "model.safetensors", info=info)
    loaded = tmp_path / "loaded.pt"
    done = subprocess.run([sys.executable, "-c", WITHOUT_ACCELERATE, str(REPO), str(path), str(loaded)],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == info
    assert same_tensors(torch.load(loaded), trained)


def folder_of(files: dict[str, str]):
    def write(tmp: Path) -> None:
        tmp.mkdir()
        for name, text in files.items():
            (tmp / name).write_text(text)
    return write


def contents(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in folder.iterdir()}


def test_a_folder_export_replaces_the_previous_one_whole_and_a_failed_write_keeps_it(accelerator, tmp_path):
    folder = tmp_path / "model"
    (tmp_path / ".tmp-model").mkdir()
    (tmp_path / ".tmp-model" / "stale").write_text("left by a crash")
    publish_export(accelerator, folder, folder_of({"weights": "1", "config": "1"}))
    assert contents(folder) == {"weights": "1", "config": "1"}  # the crashed export's file is not in it
    publish_export(accelerator, folder, folder_of({"weights": "2"}))
    assert contents(folder) == {"weights": "2"}  # replaced whole: nothing of the previous one is left

    def full_disk(tmp: Path) -> None:
        folder_of({"weights": "3"})(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SaveError, match=r"writing the export .*model failed: .*No space left on device; the "
                                        r"checkpoints are intact, so --resume auto writes it again"):
        publish_export(accelerator, folder, full_disk)
    assert contents(folder) == {"weights": "2"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # the failed write's files are freed
