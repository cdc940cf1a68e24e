"""Hugging Face mixtures of experts (and Qwen3) in and out: transformers' Mixtral, Qwen3-MoE and Qwen3 logits on one
device and on expert-parallel meshes, a device reading only its own experts, the export bit for
bit under HF's names, a trained run's export sampling its text, and every refusal as one line.

The fixtures (tests/fixtures/hf_moe_*, made by scripts/fixtures/hf_fixtures.py make --family moe with transformers
5.24) are random models with vocab 101 whose routers send tokens to every expert. Tolerance: logits
within rtol 1e-5 plus atol 1e-5 of transformers' float32 ones (of order 1 to 5).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from helpers import cached_logits, copy_with, exported_configs, logits_of
from helpers import placed as placed_on

from jaxpar.core.errors import UserError
from jaxpar.formats.hf_files import open_weights
from jaxpar.inference import export
from jaxpar.models import hf
from jaxpar.models.llama import hf_moe
from jaxpar.sample import main as sample_main

FIXTURES = Path(__file__).parent / "fixtures"
TRAINED = "tiny_moe"  # configs/tiny_moe.toml after 2 steps (conftest.TRAINED_RUNS)
MIXTRAL, QWEN3, QWEN3_MIXED, QWEN3_DENSE = (FIXTURES / name for name in (
    "hf_moe_mixtral", "hf_moe_qwen3", "hf_moe_qwen3_mixed", "hf_qwen3_dense"))
RTOL = ATOL = 1e-5


@pytest.mark.parametrize("hf_dir, spec", [(MIXTRAL, "dp=1"), (MIXTRAL, "ep=2,tp=2"), (QWEN3, "dp=1"),
                                          (QWEN3, "ep=2,tp=2"), (QWEN3_MIXED, "dp=1"), (QWEN3_MIXED, "ep=2"),
                                          (QWEN3_DENSE, "tp=2")])
def test_hf_moe_gives_transformers_logits(hf_dir, spec):
    cfg, vocab, mesh, shardings = placed_on(spec, 0, hf_dir)
    m = cfg.model
    expected_shape = {MIXTRAL: (4, True, "none", 0, 2), QWEN3: (6, False, "head", 16, 2),
                      QWEN3_MIXED: (4, True, "head", 16, 1), QWEN3_DENSE: (0, True, "head", 16, 0)}[hf_dir]
    assert (m.n_experts, m.moe_renormalize, m.qk_norm, m.head_dim, sum(m.sparse_layers)) == expected_shape
    params = hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)
    ids, expected = np.load(hf_dir / "input_ids.npy"), np.load(hf_dir / "logits.npy")
    np.testing.assert_allclose(logits_of(cfg, vocab, mesh, params, ids), expected, RTOL, ATOL)
    if spec == "dp=1":  # the KV-cache forward pass, the rest after 9 tokens went into the cache
        np.testing.assert_allclose(cached_logits(cfg, vocab, mesh, params, ids, 9), expected[:, 9:], RTOL, ATOL)


def test_the_router_convention_matters():
    """Qwen3's unrenormalised weights, renormalised, miss transformers' logits by far."""
    cfg, vocab, mesh, shardings = placed_on("dp=1", 0, QWEN3)
    params = hf.load_hf_params(QWEN3, cfg.model, vocab, shardings)
    cfg.model.moe_renormalize = True
    ids, expected = np.load(QWEN3 / "input_ids.npy"), np.load(QWEN3 / "logits.npy")
    assert np.abs(logits_of(cfg, vocab, mesh, params, ids) - expected).max() > 100 * ATOL


class Recorded:
    """A tensor that records which of its rows were read (through .T, as the readers take them)."""

    def __init__(self, array, name, log):
        self.array, self.name, self.log, self.shape = array, name, log, array.shape

    @property
    def T(self):
        return self

    def __getitem__(self, index):
        self.log.add(self.name)
        return self.array.T[index]


def test_a_device_reads_only_its_own_experts():
    cfg, vocab, _, _ = placed_on("ep=2", 0, MIXTRAL)
    tensors, path = open_weights(MIXTRAL)
    read = set()
    watched = {name: Recorded(a, name, read) if ".experts." in name else a for name, a in tensors.items()}
    readers = hf_moe.readers(watched, cfg.model, vocab,
                             hf.declared_params(cfg.model, vocab), path)
    block = readers[("blocks", "experts_gate_up", "kernel")]((slice(0, 2), slice(2, 4), slice(None), slice(None),
                                                             slice(None)))
    assert block.shape == (2, 2, 32, 2, 24)
    assert read == {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                    for i in (0, 1) for e in (2, 3) for w in ("w1", "w3")}


@pytest.mark.parametrize("hf_dir", [MIXTRAL, QWEN3, QWEN3_MIXED, QWEN3_DENSE])
def test_export_is_what_save_pretrained_writes(hf_dir):
    config, written = exported_configs(hf_dir)
    for key in ("model_type", "architectures", "num_hidden_layers", "hidden_size", "num_key_value_heads",
                "intermediate_size", "num_local_experts", "num_experts_per_tok", "tie_word_embeddings",
                "rope_parameters", "moe_intermediate_size", "norm_topk_prob", "head_dim", "decoder_sparse_step",
                "mlp_only_layers"):
        assert written.get(key) == config.get(key) or (key == "head_dim" and config[key] is None), key


@pytest.mark.parametrize("hf_dir, change, expected", [
    (QWEN3, {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 32},
     "has shared experts (shared_expert_intermediate_size=32)"),
    (QWEN3, {"model_type": "deepseek_v2", "n_shared_experts": 1, "scoring_func": "sigmoid", "n_group": 8,
             "topk_group": 4}, "shared experts (n_shared_experts=1), sigmoid routing (scoring_func=sigmoid), "
     "grouped routing (n_group=8, topk_group=4)"),
    (MIXTRAL, {"router_jitter_noise": 0.1}, "has router jitter (router_jitter_noise=0.1)"),
    (QWEN3, {"first_k_dense_replace": 1}, "DeepSeek's dense first layers (first_k_dense_replace=1)"),
    (MIXTRAL, {"num_experts_per_tok": None}, "lacks num_local_experts (or num_experts), num_experts_per_tok"),
])
def test_unsupported_moe_variants_are_one_line(tmp_path, hf_dir, change, expected):
    with pytest.raises(UserError) as error:
        hf.model_overrides_from_hf(copy_with(tmp_path, hf_dir, change))
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("config, overrides, expected", [
    ("tiny_llama", {"model.qk_norm": "full"}, "model.qk_norm=full, OLMoE's"),
    ("tiny_moe", {"model.qk_norm": "full"}, r"computes this mixture of experts \(model.qk_norm=full"),
    ("tiny_moe", {"model.moe_renormalize": False}, "no Hugging Face architecture jaxpar writes computes this"),
    ("tiny_moe", {"model.moe_every": 2}, "moe_every=2, dense_layers=''.*experts in every layer"),
])
def test_export_refuses_what_no_hf_architecture_computes(config, overrides, expected):
    cfg = tiny_config(config, **overrides)
    with pytest.raises(UserError, match=expected):
        hf.hf_config(cfg.model, 65, eot_id=0)


def test_the_export_of_a_trained_mixture_samples_its_text(trained, tmp_path, capsys):
    """The run's checkpoint, and its Mixtral export with --hf on ep=2: the same greedy text."""
    _, files = export.export(trained, tmp_path / "hf", max_shard_bytes=60_000)
    assert "model.safetensors.index.json" in files
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    greedy = ["--temperature", "0", "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    texts = []
    for source in (["--ckpt", str(trained)], ["--hf", str(tmp_path / "hf"), "--mesh", "ep=2"]):
        sample_main(source + greedy)
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("ROMEO:") and texts[0] == texts[1]
