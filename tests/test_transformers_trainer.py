"""snapd_client.transformers.Trainer's refusals, before anything is trained: a
checkpoint folder asked for, a Trainer whose methods are not those it extends, and
no transformers installed.
The resume itself is tested end to end in tests/integration/test_transformers_resume.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from snapd.errors import InvalidOption, UnsupportedState  # noqa: E402
import snapd_client.transformers as snapd_transformers  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(i, i + 4) % 16
        return {"input_ids": ids, "labels": ids}


def tiny_trainer(tmp_path):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none", max_steps=2)
    return snapd_transformers.Trainer(model=model, args=args, train_dataset=Tokens())


@pytest.mark.parametrize("given", [True, "out/checkpoint-2"])
def test_a_checkpoint_folder_is_refused_naming_the_argument(tmp_path, given):
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(InvalidOption) as caught:
        trainer.train(resume_from_checkpoint=given)
    assert caught.value.field == "resume_from_checkpoint"
    assert str(tmp_path / "snapd") in str(caught.value)
    assert not (tmp_path / "snapd").exists()   # refused before a run is created


def test_a_trainer_without_the_methods_extended_is_refused(monkeypatch):
    def _run_epoch(self, model, epoch):   # another version's signature
        pass
    monkeypatch.setattr(transformers.Trainer, "_run_epoch", _run_epoch)
    with pytest.raises(UnsupportedState) as caught:
        snapd_transformers._check_trainer_version()
    assert caught.value.field == "transformers"
    assert "Trainer._run_epoch" in str(caught.value)


def test_without_transformers_the_import_says_what_to_install(monkeypatch):
    import importlib
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)   # as if not installed
    monkeypatch.delitem(sys.modules, "snapd_client.transformers")
    with pytest.raises(ImportError, match=r"pip install 'snapd\[transformers\]'"):
        importlib.import_module("snapd_client.transformers")
