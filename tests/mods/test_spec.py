"""score_mod / mask_mod functions named on the command line (flashgen.mods.spec) and the manifest's description
of a kernel's mods (KernelMods.manifest): the words a caller of the emitted C launcher passes."""
from __future__ import annotations

import pytest
import torch

from flashgen.mods.errors import ModError
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.mods.spec import kernel_mods, load

EXAMPLES = "examples/mods.py"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)


def test_a_factory_with_defaults_is_called_and_a_function_taken_as_it_is(tmp_path):
    softcap = load(f"{EXAMPLES}:softcap", "score")
    assert softcap.__name__ == "softcap_mod"
    (tmp_path / "my_mods.py").write_text("def causal(b, h, q, kv):\n    return kv <= q\n")
    causal = load(f"{tmp_path / 'my_mods.py'}:causal", "mask")
    assert causal.__name__ == "causal" and causal(0, 0, 3, 2) and not causal(0, 0, 2, 3)


def test_a_module_name_reaches_a_function_on_the_path(tmp_path, monkeypatch):
    (tmp_path / "spec_test_mods.py").write_text("def bias(s, b, h, q, kv):\n    return s + 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load("spec_test_mods:bias", "score")(1.0, 0, 0, 0, 0) == 2.0
    with pytest.raises(ModError, match="cannot import"):
        load("no_such_package_anywhere:fn", "mask")


@pytest.mark.parametrize("spec, kind, words", [
    ("examples/mods.py", "score", "expected FILE.py:NAME"),
    ("examples/mods.py:", "score", "expected FILE.py:NAME"),
    ("missing.py:fn", "score", "no file missing.py"),
    (f"{EXAMPLES}:nope", "score", "has no 'nope'"),
    (f"{EXAMPLES}:document_mask", "score", "takes 5 arguments"),
    (f"{EXAMPLES}:softcap", "mask", "takes 4 arguments"),
    (f"{EXAMPLES}:EXAMPLES", "mask", "dict is not a function"),
])
def test_bad_specs_say_what_is_wrong(spec, kind, words):
    with pytest.raises(ModError, match=words):
        load(spec, kind)


def test_a_file_that_fails_to_import_is_reported(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ModError, match="importing .*broken.py failed: RuntimeError: boom"):
        load(f"{tmp_path / 'broken.py'}:fn", "score")


def test_the_manifest_lays_out_the_words_as_pack_and_the_launcher_do():
    gain = torch.tensor([0.5, 2.0])
    table = torch.zeros(3, 4)
    doc = torch.zeros(8, dtype=torch.int32)
    w, k = 0.25, 3

    def score_mod(s, b, h, q, kv):
        return s * w + gain[h] + table[q % 3, kv % 4] + k

    def mask_mod(b, h, q, kv):
        return doc[q] == doc[kv]

    mods, (sa, ma) = prepare_mods(score_mod, mask_mod)
    m = mods.manifest()
    assert m["n_mod_words"] == mods.n_words == 2 + (1 + 1) + (1 + 2) + (1 + 1)
    words = m["mod_words"]
    # the scalars (score's) first, then each tensor's address and strides: the offsets follow from the ranks
    assert [(x["mod"], x["variable"], x["word"]) for x in words] == [
        ("score", "w", 0), ("score", "k", 1), ("score", "gain", 2), ("score", "table", 4), ("mask", "doc", 7)]
    assert words[0]["dtype"] == "fp32" and words[1]["dtype"] == "int32" and words[4]["dtype"] == "int32"
    scalar_words, tensors = mods.pack(sa, ma)
    assert len(scalar_words) == 2 and len(tensors) == 3
    assert m["max_seq"] is None and m["key"] == mods.key


def test_specs_make_the_kernel_mods_of_their_functions():
    mods = kernel_mods(f"{EXAMPLES}:alibi", f"{EXAMPLES}:document_mask")
    assert mods.score is not None and mods.mask is not None and mods.index_limit is not None
    assert kernel_mods(None, None) is None


def test_check_compiles_the_kernel_built_with_the_specs():
    from flashgen.check import source_of
    from flashgen.dsl.configs import load as load_config

    cfg = load_config("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent")
    plain, modded = source_of(cfg), source_of(cfg, (f"{EXAMPLES}:softcap", None))
    assert modded.name == kernel_mods(f"{EXAMPLES}:softcap", None).kernel_name(plain.name)
    assert "tanh" in modded.text and "mods" in modded.meta and "mods" not in plain.meta
